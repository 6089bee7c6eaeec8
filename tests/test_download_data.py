"""scripts/download_data.py, the only code that downloads, tested without a network.

``--check`` reads what is on disk (a tiny but real MNIST in torchvision's file format is written
here), the download path fails cleanly when the network is unreachable and leaves nothing behind,
and the training side's "data missing" error names this script.
"""

from __future__ import annotations

import socket

import pytest

from helpers import run_main, write_tiny_mnist

SCRIPT = "scripts/download_data.py"


@pytest.fixture
def no_network(monkeypatch):
    """Every attempt to resolve a host or open a connection fails, and is counted."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_check_on_an_empty_folder_fails_clearly_without_network(tmp_path, no_network, capsys):
    assert run_main(SCRIPT, ["mnist", "cifar10", "--check", "--data-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"mnist: MISSING in {tmp_path} (not found or incomplete)" in captured.out
    assert "cifar10: MISSING" in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: mnist, cifar10 not found under {tmp_path}")
    assert f"python scripts/download_data.py mnist cifar10 --data-dir {tmp_path}" in err
    assert no_network == [] and list(tmp_path.iterdir()) == []  # nothing fetched, nothing written


def test_check_accepts_a_complete_mnist_that_the_data_module_reads(tmp_path, no_network, capsys):
    write_tiny_mnist(tmp_path, train=12, test=5)
    assert run_main(SCRIPT, ["mnist", "--check", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"mnist: present in {tmp_path / 'MNIST'} (train 12, test 5 samples)" in out
    assert f"pass --data-dir {tmp_path} to the training scripts" in out
    from common.data.datasets import get_dataset

    splits = get_dataset("mnist", tmp_path)  # the layout checked here is the one training reads
    assert len(splits.train) == 12 and len(splits.test) == 5 and splits.train[0][0].shape == (1, 28, 28)
    assert no_network == []


def test_check_reports_an_incomplete_mnist(tmp_path, no_network, capsys):
    write_tiny_mnist(tmp_path)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    assert run_main(SCRIPT, ["mnist", "--check", "--data-dir", str(tmp_path)]) == 2
    assert "mnist: MISSING" in capsys.readouterr().out


def test_download_without_network_fails_cleanly_and_leaves_nothing(tmp_path, no_network, capsys):
    data = tmp_path / "data" / "course"
    assert run_main(SCRIPT, ["mnist", "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: could not download mnist:")
    assert "run this on a login node" in err
    assert no_network, "the download path should have tried the network"
    assert list(tmp_path.iterdir()) == []  # not even the folders it made for the download
    data.mkdir(parents=True)
    assert run_main(SCRIPT, ["mnist", "--data-dir", str(data)]) == 2
    assert list(data.iterdir()) == []  # a folder that was there stays, with no MNIST/ and no staging folder


def test_training_side_missing_data_error_names_this_script(tmp_path):
    from common.data.datasets import get_dataset
    from common.errors import UserError

    for name in ("mnist", "cifar10"):
        with pytest.raises(UserError) as err:
            get_dataset(name, tmp_path)
        assert f"python scripts/download_data.py {name} --data-dir {tmp_path}" in str(err.value)


def test_unknown_dataset_is_an_argparse_error(capsys):
    assert run_main(SCRIPT, ["imagenet", "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: argument DATASET: invalid choice: 'imagenet'") and len(err.splitlines()) == 1
