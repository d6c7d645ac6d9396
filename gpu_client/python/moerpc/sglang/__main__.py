"""python -m moerpc.sglang [--moerpc-dry-run] SGLANG_LAUNCH_SERVER_ARGS...

Installs the kt-kernel hook (moerpc.sglang.install), sets MOERPC_SGLANG_HOOK=1 so that the
processes sglang starts install it too, and runs `sglang.launch_server` with the remaining
arguments, unchanged: `--kt-method MOERPC --kt-weight-path cluster.json` selects moerpc's
expert servers; every other --kt-* flag keeps its sglang-kt meaning (--kt-num-gpu-experts
and the placement strategy decide gpu_experts_mask, i.e. which experts stay on the GPU;
--kt-max-deferred-experts-per-token the deferral). --moerpc-dry-run checks everything,
prints what it would run, and exits 0.
"""
import os
import runpy
import sys


def _flag(argv, name):
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _pth_installed() -> bool:
    return any(os.path.isfile(os.path.join(p, "moerpc-sglang-hook.pth"))
               for p in sys.path if p and os.path.isdir(p))


def main(argv):
    dry = "--moerpc-dry-run" in argv
    argv = [a for a in argv if a != "--moerpc-dry-run"]
    from . import METHOD, check_versions, install
    method = _flag(argv, "--kt-method")
    if method is not None and method.upper() == METHOD:
        path = _flag(argv, "--kt-weight-path")
        if not path:
            sys.exit("moerpc.sglang: --kt-method MOERPC needs --kt-weight-path CLUSTER.json")
        if not os.path.isfile(path):
            sys.exit(f"moerpc.sglang: --kt-weight-path {path}: no such file (with --kt-method "
                     "MOERPC it names the moerpc cluster file)")
        from .. import _lib
        _lib.lib()  # the C library must load here, not in a worker
    versions = check_versions()
    install()
    os.environ["MOERPC_SGLANG_HOOK"] = "1"
    if not _pth_installed():
        print("moerpc.sglang: warning: moerpc-sglang-hook.pth is not in site-packages (moerpc "
              "not installed with pip?); processes sglang spawns will not have the hook",
              file=sys.stderr)
    if dry:
        print(f"moerpc.sglang: hook installed (kt-kernel {versions['kt-kernel']}, sglang-kt "
              f"{versions['sglang-kt']}); would run: sglang.launch_server {' '.join(argv)}")
        return
    sys.argv = ["sglang.launch_server"] + argv
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
