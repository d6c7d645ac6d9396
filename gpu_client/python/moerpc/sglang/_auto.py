"""Imported by moerpc-sglang-hook.pth in every Python process whose environment has
MOERPC_SGLANG_HOOK=1: hooks kt-kernel's factory when it is imported (moerpc.sglang)."""
from . import install_on_import

install_on_import()
