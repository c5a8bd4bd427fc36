"""Backends: where Programs run. Only ``mindspore`` exists."""
