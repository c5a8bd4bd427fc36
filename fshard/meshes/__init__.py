"""The meshes layer: MindSpore's Layout vocabulary (``layout``), ``fs.Mesh`` (``mesh``),
the process world of a multi-process job (``distributed``) and pictures of layouts
(``visualize``)."""
