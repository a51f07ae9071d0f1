"""bench/main_job.py: both backends serve the same requests in one process, the order
alternating by round, the warm-up only in each backend's first run."""

from __future__ import annotations

import pytest

from scripts import load_script

MJ = load_script("bench/main_job.py")
SMALL = ["--max-tokens", "64", "--prompt-len", "4", "12", "--new-tokens", "2", "6", "--layers", "1"]


def test_rounds_alternate_and_give_one_ratio_each(monkeypatch, tmp_path) -> None:
    runs: list[tuple[str, int, bool]] = []
    serve = MJ.serve

    def logged(backend, batch, warmup, extra, out):
        runs.append((backend, batch, warmup))
        return serve(backend, batch, warmup, extra, out)

    monkeypatch.setattr(MJ, "serve", logged)
    out = tmp_path / "mj.json"
    report = MJ.main(["--batch", "2", "--rounds", "3", "--json", str(out), "--", *SMALL])
    v, p = "jax_vmm", "prealloc"
    assert runs == [(v, 2, True), (p, 2, True), (p, 2, False), (v, 2, False), (v, 2, False),
                    (p, 2, False)]  # fmt: skip
    got = report["batches"][2]
    assert [r["order"] for r in got["rounds"]] == [[v, p], [p, v], [v, p]]
    ratios = [r["tokens_per_second"][v] / r["tokens_per_second"][p] for r in got["rounds"]]
    assert got["median_ratio"] == pytest.approx(sorted(ratios)[1])
    assert out.exists()


def test_zero_rounds_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        MJ.main(["--rounds", "0"])
