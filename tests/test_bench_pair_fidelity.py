"""Pairing separate fidelity runs: a method against the mean of a press's draws, passage by
passage, and sources that name no method are refused naming their flag."""

import json

import pytest

from benchmarks import pair_fidelity


def per_position(path, methods: dict[str, list[list[float]]], length: int = 4096):
    """A `--per-position` file whose methods have these KL per passage and position."""
    positions = [1024 + 64 * i for i in range(len(next(iter(methods.values()))[0]))]
    entry = {name: {"top1": [[1.0] * len(p) for p in kl], "kl": kl} for name, kl in methods.items()}
    path.write_text(json.dumps({str(length): {"positions": positions, "methods": entry}}))
    return str(path)


def test_a_method_is_paired_with_the_mean_of_the_references_draws(tmp_path, capsys):
    first = per_position(tmp_path / "a.json", {"full": [[0, 0]] * 3, "press": [[0.1, 0.1]] * 3})
    second = per_position(tmp_path / "b.json", {"press": [[0.3, 0.3]] * 3})
    ours = per_position(tmp_path / "c.json", {"ours": [[0.2, 0.2], [0.1, 0.3], [0.3, 0.1]]})
    pair_fidelity.main(["--length", "4096", "--reference", first, "--reference", second,
                        "--method", ours])  # fmt: skip
    rows = {line.split(" | ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "+0.0000 ± 0.000 | 1.000×" in rows["| method 1: ours"]
    assert "-0.1000 ± 0.000 | 0.500×" in rows["| reference 1: press"]
    assert "| 0.2000 | | 1.000× |" in rows["| reference: mean of 2"]


def test_a_file_of_several_methods_needs_a_label_and_the_flag_is_named(tmp_path, capsys):
    both = per_position(tmp_path / "a.json", {"press": [[0.1]], "ours": [[0.2]]})
    with pytest.raises(SystemExit) as exit_:
        pair_fidelity.main(["--length", "4096", "--reference", both])
    assert exit_.value.code == 2
    assert "--reference" in capsys.readouterr().err
    pair_fidelity.main(["--length", "4096", "--reference", f"{both}::press"])


def test_runs_of_other_passages_are_not_paired(tmp_path, capsys):
    three = per_position(tmp_path / "a.json", {"press": [[0.1]] * 3})
    two = per_position(tmp_path / "b.json", {"ours": [[0.1]] * 2})
    with pytest.raises(SystemExit) as exit_:
        pair_fidelity.main(["--length", "4096", "--reference", three, "--method", two])
    assert exit_.value.code == 2
    assert "passages and positions differ" in capsys.readouterr().err
