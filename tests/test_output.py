"""sonic._output: output files named on a command line are checked before any work."""

import os

import pytest

from sonic._output import check_writable, image_path


def test_writable_paths_pass_and_nothing_is_created(tmp_path):
    assert check_writable("--save", tmp_path / "new.pt") == tmp_path / "new.pt"
    existing = tmp_path / "old.jsonl"
    existing.write_text("x")
    assert check_writable("--log-jsonl", str(existing)) == existing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]


@pytest.mark.parametrize("make, message", [
    (lambda t: t / "missing" / "f.pt", "the folder"),
    (lambda t: t, "is a folder; expected a file path"),
])
def test_unusable_paths_are_named(tmp_path, make, message):
    with pytest.raises(ValueError, match=f"--save: .*{message}|--save: {message}"):
        check_writable("--save", make(tmp_path))


@pytest.mark.parametrize("existing", [False, True])
def test_read_only_folder_or_file(tmp_path, monkeypatch, existing):
    # Tests may run as root, for whom every path is writable: os.access stands in for the
    # permission bits.
    target = tmp_path / "f.pt"
    if existing:
        target.write_text("x")
    denied = target if existing else tmp_path
    real_access = os.access
    monkeypatch.setattr(os, "access",
                        lambda p, mode: False if str(p) == str(denied) else real_access(p, mode))
    with pytest.raises(ValueError, match="--save: .* is not writable"):
        check_writable("--save", target)


def test_image_path(tmp_path):
    pytest.importorskip("matplotlib")
    assert image_path("--plot", tmp_path / "noext") == tmp_path / "noext.png"
    assert image_path("--plot", tmp_path / "a.SVG") == tmp_path / "a.SVG"
    with pytest.raises(ValueError, match="--plot: cannot write '.xyz' images; expected one of"):
        image_path("--plot", tmp_path / "a.xyz")
    with pytest.raises(ValueError, match="does not exist"):
        image_path("--plot", tmp_path / "no" / "a.png")
