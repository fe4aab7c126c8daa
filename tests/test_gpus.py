"""GPU table, resolve_gpu and the cuBLAS / cuBLASLt workspace sizes (CublasHandlePool.cpp)."""

import pytest
import torch

from estimator.vocab.errors import InputError
from estimator.vocab.gpus import (
    GPUS,
    GpuSpec,
    cublas_workspace_bytes,
    cublaslt_extra_bytes,
    cublaslt_workspace_bytes,
    resolve_gpu,
)

# --- cuBLAS workspace defaults (parseChosenWorkspaceSize) ---------------------------------

def test_default_workspace_pre_hopper():
    # 4096 * 1024 * 2 + 16 * 1024 * 8 = 8,388,608 + 131,072 = 8,519,680
    for arch in ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89"):
        assert cublas_workspace_bytes(arch) == 8_519_680
    assert cublas_workspace_bytes("A100 80GB") == 8_519_680
    assert cublas_workspace_bytes((8, 0)) == 8_519_680


def test_default_workspace_hopper_and_blackwell():
    # 4096 * 8 * 1024 = 33,554,432 = 32 MiB for major 9, 10, 11, 12
    assert cublas_workspace_bytes("sm_90") == 33_554_432
    assert cublas_workspace_bytes("H200") == 33_554_432
    assert cublas_workspace_bytes(resolve_gpu("NVIDIA H100 80GB HBM3")) == 33_554_432
    for arch in ("sm_100", "sm_110", "sm_120"):
        assert cublas_workspace_bytes(arch) == 33_554_432


# --- CUBLAS_WORKSPACE_CONFIG ----------------------------------------------------------------

def test_config_4096_8():
    # 4096 KiB * 1024 * 8 = 33,554,432
    assert cublas_workspace_bytes("sm_80", ":4096:8") == 33_554_432


def test_config_16_8():
    # 16 KiB * 1024 * 8 = 131,072 (also on Hopper: the env wins over the 32 MiB default)
    assert cublas_workspace_bytes("sm_80", ":16:8") == 131_072
    assert cublas_workspace_bytes("sm_90", ":16:8") == 131_072


def test_config_two_pairs():
    # 4096*1024*2 + 16*1024*8 = 8,388,608 + 131,072 = 8,519,680
    assert cublas_workspace_bytes("sm_90", ":4096:2:16:8") == 8_519_680


def test_config_zero():
    # 0 KiB * 1024 * 8 = 0
    assert cublas_workspace_bytes("sm_80", ":0:8") == 0


@pytest.mark.parametrize("bad", ["", "4096:8", "garbage", ":4096"])
def test_config_unparsable_falls_back_to_default(bad):
    # no ':N:N' match -> TORCH_WARN + default: 8,519,680 (sm_80) / 33,554,432 (sm_90)
    assert cublas_workspace_bytes("sm_80", bad) == 8_519_680
    assert cublas_workspace_bytes("sm_90", bad) == 33_554_432


def test_config_out_of_range_raises():
    with pytest.raises(InputError):
        cublas_workspace_bytes("sm_80", ":99999999999999999999:1")


def test_default_needs_arch():
    # a bare memory figure has no compute capability -> no default
    with pytest.raises(InputError, match="compute capability"):
        cublas_workspace_bytes("80GiB")
    # ...but an explicit config needs none: 4096 * 1024 * 8 = 33,554,432
    assert cublas_workspace_bytes("80GiB", ":4096:8") == 33_554_432


# --- cuBLASLt (parseCUDABlasLtWorkspaceSize / getCUDABlasLtWorkspaceSize) --------------------

def test_cublaslt_default():
    # 1024 KiB * 1024 = 1,048,576; min(1,048,576, 8,519,680) = 1,048,576 when unified
    assert cublaslt_workspace_bytes("sm_80") == 1_048_576
    assert cublaslt_workspace_bytes("sm_80", unified=False) == 1_048_576


def test_cublaslt_env_kib():
    # 4096 KiB * 1024 = 4,194,304
    assert cublaslt_workspace_bytes("sm_90", "4096") == 4_194_304
    # std::stoi reads leading digits: "2048kb" -> 2048 KiB -> 2,097,152
    assert cublaslt_workspace_bytes("sm_90", " 2048kb") == 2_097_152


def test_cublaslt_capped_by_cublas_when_unified():
    # 65536 KiB * 1024 = 67,108,864 > cuBLAS 8,519,680 -> capped to 8,519,680
    assert cublaslt_workspace_bytes("sm_80", "65536") == 8_519_680
    # not unified: 67,108,864
    assert cublaslt_workspace_bytes("sm_80", "65536", unified=False) == 67_108_864
    # cap follows CUBLAS_WORKSPACE_CONFIG: ':16:8' -> 131,072
    assert cublaslt_workspace_bytes("sm_80", cublas_env=":16:8") == 131_072


@pytest.mark.parametrize("bad", ["abc", "", "99999999999"])
def test_cublaslt_invalid_falls_back(bad):
    # invalid_argument / out_of_range -> default 1024 KiB = 1,048,576
    assert cublaslt_workspace_bytes("sm_80", bad) == 1_048_576


def test_cublaslt_negative_raises():
    with pytest.raises(InputError):
        cublaslt_workspace_bytes("sm_80", "-1")


def test_cublaslt_extra():
    assert cublaslt_extra_bytes("sm_90") == 0                      # unified: shares the cuBLAS one
    assert cublaslt_extra_bytes("sm_90", unified=False) == 1_048_576  # 1024 KiB * 1024


# --- resolve_gpu -----------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", [
    "H100", "h100", "NVIDIA H100 80GB HBM3", "h100-80gb", "H100_SXM", "  h100 sxm5 80GB ",
])
def test_resolve_h100_spellings(spelling):
    spec = resolve_gpu(spelling)
    assert spec.name == "NVIDIA H100 80GB HBM3"
    assert (spec.major, spec.minor, spec.arch) == (9, 0, "sm_90")


@pytest.mark.parametrize("spelling,name", [
    ("NVIDIA H200", "NVIDIA H200"),
    ("h200", "NVIDIA H200"),
    ("H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"),
    ("a100-80gb", "NVIDIA A100-SXM4-80GB"),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100-SXM4-80GB"),
    ("A10", "NVIDIA A10"),
    ("a10g", "NVIDIA A10G"),
    ("L4", "NVIDIA L4"),
    ("l40s", "NVIDIA L40S"),
    ("Tesla T4", "Tesla T4"),
    ("t4", "Tesla T4"),
    ("V100-32GB", "Tesla V100-SXM2-32GB"),
    ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-16GB"),
    ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),
    ("rtx4090", "NVIDIA GeForce RTX 4090"),
    ("RTX 3090", "NVIDIA GeForce RTX 3090"),
])
def test_resolve_names(spelling, name):
    assert resolve_gpu(spelling).name == name


def test_table_facts():
    h200 = resolve_gpu("h200")
    assert h200.total_memory == 143156 * 2**20 == 150_109_945_856   # ~139.8 GiB
    assert 139.7 < h200.total_memory / 2**30 < 139.9
    assert resolve_gpu("a100-40gb").total_memory == 42_298_834_944  # deviceQuery, observed
    assert resolve_gpu("t4").arch == "sm_75"
    assert resolve_gpu("l4").arch == "sm_89"
    assert resolve_gpu("a10g").arch == "sm_86"
    assert resolve_gpu("v100 16gb").arch == "sm_70"
    assert resolve_gpu("4070 ti super").sm_count == 66 and resolve_gpu("rtx 4070 ti super").arch == "sm_89"
    assert len({s.name for s in GPUS}) == len(GPUS) == 15
    assert all(isinstance(s, GpuSpec) and s.total_memory > 2**30 for s in GPUS)


def test_resolve_arch():
    spec = resolve_gpu("sm_90")
    assert (spec.major, spec.minor, spec.total_memory) == (9, 0, None)
    assert resolve_gpu("sm_80").arch == "sm_80"
    assert resolve_gpu("SM86").arch == "sm_86"
    assert resolve_gpu("sm_90a").arch == "sm_90"
    assert (resolve_gpu("sm_100").major, resolve_gpu("sm_100").minor) == (10, 0)


def test_resolve_memory():
    # 80 * 2**30 = 85,899,345,920
    assert resolve_gpu("80GiB").total_memory == 85_899_345_920
    # 40 * 10**9 = 40,000,000,000
    assert resolve_gpu("40 GB").total_memory == 40_000_000_000
    spec = resolve_gpu(24 * 2**30)
    assert (spec.total_memory, spec.major, spec.arch) == (25_769_803_776, None, None)


def test_resolve_passthrough():
    spec = resolve_gpu("l4")
    assert resolve_gpu(spec) is spec


def test_unknown_name_suggests():
    with pytest.raises(InputError) as err:
        resolve_gpu("h10")
    msg = str(err.value)
    assert "did you mean" in msg and "h100" in msg.lower()
    assert "sm_90" in msg and "80GiB" in msg  # accepted forms are listed


def test_unknown_name_typo_suggests():
    with pytest.raises(InputError, match="did you mean.*l40s"):
        resolve_gpu("L40x")


@pytest.mark.parametrize("typed,name,memory", [
    # The smaller-memory variant of each family (gpus._FAMILIES): budgeted for it, a batch fits both.
    ("A100", "NVIDIA A100-SXM4-40GB", 42_298_834_944),   # deviceQuery, observed
    (" a100 ", "NVIDIA A100-SXM4-40GB", 42_298_834_944),
    ("A100 PCIe", "NVIDIA A100-SXM4-40GB", 42_298_834_944),
    ("V100", "Tesla V100-SXM2-16GB", 17_179_869_184),    # nominal 16 * 2**30
    ("Tesla V100", "Tesla V100-SXM2-16GB", 17_179_869_184),
])
def test_family_name_takes_a_variant_and_remembers_the_name(typed, name, memory):
    spec = resolve_gpu(typed)
    assert (spec.name, spec.total_memory, spec.taken_for) == (name, memory, typed.strip())
    assert spec == resolve_gpu(name)  # the same GPU; only the report's wording differs
    assert resolve_gpu(name).taken_for is None


def test_family_variant_is_described_with_its_memory():
    # 42,298,834,944 B / 2**30 = 39.39 GiB: the default budget of max_batch / fits.
    assert resolve_gpu("A100").describe() == (
        'NVIDIA A100-SXM4-40GB, taken for "A100"; memory differs between variants: budgets use this '
        "one's 39.39 GiB, say \"A100 80GB\" for the NVIDIA A100-SXM4-80GB")
    assert resolve_gpu("V100").describe().startswith('Tesla V100-SXM2-16GB, taken for "V100"; memory differs')
    # a name that says the variant, or a name with one variant, describes itself by its name only
    for typed in ("A100 80GB", "V100-32GB", "H100", "sm_80", "24GiB"):
        assert resolve_gpu(typed).describe() == resolve_gpu(typed).name
    # the other variant is reachable with the name the description suggests
    assert resolve_gpu("A100 80GB").name == "NVIDIA A100-SXM4-80GB"
    assert resolve_gpu("V100 32GB").name == "Tesla V100-SXM2-32GB"


def test_family_variant_in_the_report_first_line_and_budget():
    import estimator

    rep = estimator.report(torch.nn.Linear(8, 4), torch.randn(2, 8), optimizer="sgd", device="cuda", gpu="A100")
    first = str(rep).splitlines()[0]
    assert ', on NVIDIA A100-SXM4-40GB (taken for "A100"; memory differs between variants' in first
    # the default budget is the variant's memory (less the CUDA context), as the line says
    assert rep.max_batch() == rep.max_batch(42_298_834_944)
    assert rep.target.gpu.taken_for == "A100"


def test_cli_accepts_a_family_name():
    from click.testing import CliRunner

    from estimator.cli import cli

    result = CliRunner().invoke(cli, ["report", "mlp", "--gpu", "V100", "-q"])  # the GPU target is the default
    assert result.exit_code == 0, result.output
    assert ', on Tesla V100-SXM2-16GB (taken for "V100"; memory differs' in result.stdout.splitlines()[0]


@pytest.mark.parametrize("bad", ["banana", "80 parsecs", True, 3.5, -5, "rtx 9999"])
def test_bad_specs_raise(bad):
    with pytest.raises(InputError):
        resolve_gpu(bad)
