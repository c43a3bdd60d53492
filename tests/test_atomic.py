"""atomic_write never writes through a link planted in its directory's place."""

from __future__ import annotations

import pytest

from amp_exp.errors import RuntimeFault
from amp_exp.runtime.atomic import atomic_write


def test_a_directory_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path):
    """Would catch a write that follows the link into the victim directory."""
    victim = tmp_path / "victim"
    victim.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(victim)
    with pytest.raises(RuntimeFault, match="is a link"):
        atomic_write(run / "checkpoints" / "state.pt", lambda f: f.write(b"x"))
    assert list(victim.iterdir()) == []


def test_an_ordinary_directory_gets_the_file(tmp_path):
    """Would catch the link check refusing a plain directory."""
    target = tmp_path / "run" / "summary.json"
    atomic_write(target, lambda f: f.write(b"{}"))
    assert target.read_bytes() == b"{}"
