"""The core layer: types, dimensions, pytrees, the state tracing needs, the rule tables,
tracing (``tracing``: Trace, Tracer, ``bind``), the IR, staging and the interpreter.
It imports nothing of fshard but ``fshard.errors``."""
