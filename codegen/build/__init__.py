"""Build: nvcc through a content-addressed cache, parallel, then one static-library object."""
from .cache import BuildError, build_each, build_many, build_object, cache_key, cache_root
from .link import kernel_entries, link_module
from .toolchain import find_nvcc

__all__ = ["BuildError", "build_each", "build_many", "build_object", "cache_key", "cache_root", "find_nvcc", "link_module"]
