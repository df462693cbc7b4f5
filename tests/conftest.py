"""Suite-wide fixtures.

Every XLA:CPU executable keeps its own memory mappings until it is freed, and one pytest
process compiles thousands of programs: without freeing them the process reaches the kernel's
``vm.max_map_count`` (65530 by default) and the next compile crashes inside LLVM. Each test
module therefore drops jax's compilation caches when it ends.
"""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
