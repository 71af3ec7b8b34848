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
