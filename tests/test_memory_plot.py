"""``python -m sonic.memory --plot``: activation memory over granularity at fixed FLOPs."""

import json
import sys

import pytest
import torch

from sonic.memory.__main__ import granularity_sweep, main


def test_sweep_keeps_flops_and_activation_ratio():
    rows = granularity_sweep((1024, 512, 512, 4, 1), (1, 2, 4, 8), torch.device("meta"))
    assert [r["granularity"] for r in rows] == [1, 2, 4, 8]
    assert {r["K"] * r["n"] for r in rows} == {512}
    assert {r["K"] / r["E"] for r in rows} == {1 / 4}
    # SonicMoE Fig. 1: sonic's bytes barely move (H is T·K·2n, fixed), the baseline's grow.
    sonic = [r["sonic_MiB"] for r in rows]
    torch_gmm = [r["torch_MiB"] for r in rows]
    assert max(sonic) < 1.1 * min(sonic)
    assert torch_gmm == sorted(torch_gmm) and torch_gmm[-1] > 2 * torch_gmm[0]


def test_sweep_rejects_scale_not_dividing_n():
    with pytest.raises(ValueError, match="scale 3 does not divide n=64"):
        granularity_sweep((256, 64, 64, 4, 1), (1, 3), torch.device("meta"))


def test_cli_plot_writes_image_and_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "fig1.png"
    assert main(["--config", "256,64,64,4,1", "--plot", str(path), "--scales", "1,2,4",
                 "--json", "--top", "0"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["n"] for r in summary["sweep"]] == [64, 32, 16]


def test_cli_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(SystemExit):
        main(["--config", "256,64,64,4,1", "--plot", str(tmp_path / "f.png")])
    assert "pip install 'sonic-cute-moe[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--scales", "1,2"], "--scales only applies with --plot"),
    (["--scales", "0,2", "--plot", "f.png"], "distinct positive integers"),
    (["--scales", "1,3", "--plot", "f.png"], "scale 3 does not divide n=64"),
])
def test_cli_plot_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["--config", "256,64,64,4,1", *argv])
    assert message in capsys.readouterr().err
