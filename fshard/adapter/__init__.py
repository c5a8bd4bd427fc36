"""The MindSpore adapter: what makes native ``mindspore.ops`` calls (``interop``), Tensor
operators and methods (``tensor_methods``) and ``nn.Cell``s (``cells``) trace."""
