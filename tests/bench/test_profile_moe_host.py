"""bench.profile_moe_host on the CPU at bench_moe's quick shapes: the rows it names are profiled."""

import pytest

from bench import common, moe_layer, profile_moe_host


def test_profiles_the_named_rows(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    clocks, real = [], profile_moe_host.host_ms

    def host_ms(step, model, **kw):
        clocks.append(getattr(model, "sync", None))
        return real(step, model, **kw)
    monkeypatch.setattr(profile_moe_host, "host_ms", host_ms)
    out = tmp_path / "p.txt"
    profile_moe_host.main(["--quick", "--experts", "8", "--top", "80", "--warmup", "1", "--reps", "1", "--out", str(out),
                           "--variants", "BF16 grouped|hybridfp FP8 current [quantized primary weights]"])
    text = out.read_text()
    assert "## BF16 grouped: host ms (median of 1, unprofiled)" in text
    assert "## hybridfp FP8 current [quantized primary weights]: host ms" in text
    assert text.count(", of it at syncs ") == 2  # the routing syncs' waits beside each host time
    assert len(clocks) == 2 and all(isinstance(c, moe_layer.SyncClock) for c in clocks)  # each row's own layer
    assert text.count("### by tottime") == 2 and text.count("### by cumulative") == 2
    # the primary-weight row re-encodes its weights from FP32 masters in its step
    assert "before_step" in text.split("## hybridfp FP8 current [quantized primary weights]")[1]


def test_unknown_row_and_config_refused(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    with pytest.raises(SystemExit):
        profile_moe_host.main(["--quick", "--experts", "64", "--variants", "hybridfp FP9"])
    with pytest.raises(SystemExit):
        profile_moe_host.main(["--quick", "--experts", "7"])
    with pytest.raises(SystemExit):
        profile_moe_host.main(["--quick", "--reps", "0"])


def test_torch_profiler_splits_the_host_time(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    out = tmp_path / "p.txt"
    profile_moe_host.main(["--quick", "--experts", "8", "--top", "20", "--warmup", "1", "--reps", "1", "--out", str(out),
                           "--torch-profiler", "--variants", "hybridfp FP8 current [quantized primary weights]"])
    text = out.read_text()
    assert "## hybridfp FP8 current [quantized primary weights]: host ms" in text
    split = text.split("profiled step: host ")[1].splitlines()[0]
    # on the CPU no CUDA API is called; the step's aten ops are counted with their own time
    assert " CUDA API calls 0.00 ms, of it 0 kernel launches 0.00 ms; " in split
    ops = int(split.split("; ")[2].split(" aten ops")[0])
    assert ops > 50, split
    assert "### by own host time" in text and "aten::" in text


def test_api_split_sorts_events_by_kind():
    class Event:
        def __init__(self, key, count, us):
            self.key, self.count, self.self_cpu_time_total = key, count, us
    split = profile_moe_host.api_split([Event("cudaLaunchKernel", 10, 500.0), Event("cuLaunchKernelEx", 4, 300.0),
                                        Event("cudaMemcpyAsync", 2, 200.0), Event("aten::mul", 7, 70.0),
                                        Event("aten::empty", 3, 30.0), Event("MyRegion", 1, 1000.0)])
    assert split == {"api_ms": 1.0, "launches": 14, "launch_ms": 0.8, "aten_ops": 10, "aten_ms": 0.1}


def test_cpu_stub_counts_the_fused_swiglu_row(monkeypatch, tmp_path):
    from bench import bench_moe_overhead
    monkeypatch.setattr(common, "DEVICE", "cuda")  # --cpu-stub moves it to the CPU; restored after the test
    # the stubs patched through monkeypatch, so that they are undone after the test
    monkeypatch.setattr(profile_moe_host, "stub_gpu_paths",
                        lambda launches=None: bench_moe_overhead.stub_gpu_paths(monkeypatch.setattr, launches))
    out = tmp_path / "p.txt"
    eager, fused = "hybridfp FP8 current [quantized primary weights]", "hybridfp FP8 current [quantized primary weights] [fused SwiGLU]"
    profile_moe_host.main(["--cpu-stub", "--experts", "64", "--warmup", "1", "--top", "5", "--out", str(out),
                           "--variants", f"{eager}|{fused}"])
    text = out.read_text()
    assert common.DEVICE == "cpu"

    def counts(row: str) -> tuple[int, int, dict[str, int]]:
        line = text.split(f"## {row}: counted on the CPU, the GPU's work stubbed\n")[1].splitlines()[0]
        calls = int(line.split("one step: ")[1].split(" Python calls")[0])
        ops = int(line.split(" Python calls, ")[1].split(" aten ops")[0])
        listed = line.split(" launches stubbed (", 1)[1][:-1].split(", ")
        kernels = {k.rsplit(" ", 1)[0]: int(k.rsplit(" ", 1)[1]) for k in listed}
        return calls, ops, kernels
    (ce, oe, ke), (_, _, kf) = counts(eager), counts(fused)
    assert ce > 1000 and oe > 100  # the layer's host work: 4 micro-batches, two GroupedLinears
    # the fused row takes the SwiGLU kernels (one each way a micro-batch) and, given the
    # experts' splits, they record h's and its gradient's amaxes: two amax passes fewer a micro-batch
    assert kf["_swiglu_fwd_kernel"] == 4 and kf["_swiglu_bwd_kernel"] == 4 and "_swiglu_fwd_kernel" not in ke
    assert ke["_group_amax_kernel"] - kf["_group_amax_kernel"] == 8
    assert kf["grouped FP8 GEMM (Triton)"] == ke["grouped FP8 GEMM (Triton)"] == 24  # 2 layers x 3 GEMMs x 4
    assert text.count("### aten ops by count") == 2


def test_cpu_stub_refuses_the_torch_profiler(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    with pytest.raises(SystemExit):
        profile_moe_host.main(["--cpu-stub", "--torch-profiler"])
