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


def test_cli_help_example_plots_with_default_scales(tmp_path, capsys):
    """The help's own example: the default scales keep only those the config can run (n = 16
    on meta: n/s a multiple of 8, so scales 1 and 2)."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "x.png"
    assert main(["--config", "64,32,16,8,2", "--plot", str(path), "--json", "--top", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["scale"] for r in summary["sweep"]] == [1, 2] and path.stat().st_size > 1000


def test_cli_plot_without_suffix_reports_the_png_it_writes(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["--config", "256,64,64,4,1", "--plot", str(tmp_path / "noext"),
                 "--scales", "1,2", "--top", "0"]) == 0
    assert f"plotted to {tmp_path / 'noext.png'}" in capsys.readouterr().out
    assert (tmp_path / "noext.png").exists() and not (tmp_path / "noext").exists()


@pytest.mark.parametrize("plot, scales, message", [
    ("missing/dir/f.png", None, "does not exist"),
    ("f.xyz", None, "cannot write '.xyz' images"),
    ("f.png", "1,16", "n/s=4, not a multiple of 8"),
    ("f.png", "1,3", "scale 3 does not divide n=64"),
])
def test_cli_plot_errors_come_before_measuring(tmp_path, capsys, monkeypatch, plot, scales,
                                               message):
    pytest.importorskip("matplotlib")
    import sonic.memory.__main__ as cli

    def not_expected(*args, **kwargs):
        raise AssertionError("measured before checking --plot/--scales")

    monkeypatch.setattr(cli, "measure", not_expected)
    argv = ["--config", "256,64,64,4,1", "--plot", str(tmp_path / plot)]
    with pytest.raises(SystemExit) as exc:
        main(argv + (["--scales", scales] if scales else []))
    assert exc.value.code == 2 and message in capsys.readouterr().err
