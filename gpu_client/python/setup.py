"""pip install ./gpu_client/python - the moerpc Python package (a ctypes binding of
libmoerpc-client, MoeRpcWrapper, the sglang-kt hook).

The shared library is taken from $MOERPC_LIB when set, else built in the moerpc tree this
directory belongs to (`make build/lib/libmoerpc-client.so`, BUILD=build) and copied into the
package (moerpc/lib/). Without either, the package installs without it and looks for it at
run time (moerpc/_lib.py). The wheel also carries moerpc-sglang-hook.pth (site-packages),
which hooks kt-kernel in processes started with MOERPC_SGLANG_HOOK=1 and does nothing
otherwise.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SO = "libmoerpc-client.so"
PTH = ('import os; os.environ.get("MOERPC_SGLANG_HOOK") == "1" and '
       '__import__("moerpc.sglang._auto")\n')


def find_or_build_lib():
    env = os.environ.get("MOERPC_LIB")
    if env:
        if not os.path.isfile(env):
            raise SystemExit(f"MOERPC_LIB={env}: no such file")
        return env
    if os.path.isfile(os.path.join(REPO, "Makefile")):
        target = os.path.join("build", "lib", SO)
        r = subprocess.run(["make", "-C", REPO, "--no-print-directory", target])
        if r.returncode == 0:
            return os.path.join(REPO, target)
        print(f"moerpc: make {target} failed ({r.returncode}); installing without the library")
    return None


class BuildPy(build_py):
    def run(self):
        super().run()
        lib = find_or_build_lib()
        if lib:
            dst = os.path.join(self.build_lib, "moerpc", "lib")
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(lib, os.path.join(dst, SO))
        with open(os.path.join(self.build_lib, "moerpc-sglang-hook.pth"), "w") as f:
            f.write(PTH)


setup(
    name="moerpc",
    version="0.1.0",
    description="moerpc client: remote MoE experts behind kt-kernel's KTMoEWrapper contract",
    packages=["moerpc", "moerpc.sglang"],
    python_requires=">=3.9",
    cmdclass={"build_py": BuildPy},
    zip_safe=False,
)
