"""`tinyrun info FILE --check`: every tensor's CRC-32 is verified and a corrupt tensor is named."""

from __future__ import annotations

import pytest

from tinf_samples import TENSORS, flip_byte, write_runnable_tinf, write_tiny_tinf  # noqa: E402
from tinyinfer.formats import FormatError, open_tinf  # noqa: E402
from tinyinfer.runtime.integrity import IntegrityError, check_file, corrupt_tensors  # noqa: E402


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_tinf(tmp_path / "m.tinf")


def test_a_clean_file_passes(tiny):
    assert check_file(tiny, progress=False) == len(TENSORS)


@pytest.mark.parametrize("tensor, at", [("layers.0.wqkv", 0), ("layers.0.w_down", -1), ("norm", 100),
                                        ("output", -3)])   # q4 values, q4 scale section, f32, last scales
def test_a_flipped_byte_names_its_tensor_and_no_other(tiny, tensor, at):
    flip_byte(tiny, tensor, at)
    with open_tinf(tiny) as f:   # the header and directory are still valid: only the data changed
        assert corrupt_tensors(f, progress=False) == [tensor]
    with pytest.raises(IntegrityError) as e:
        check_file(tiny, progress=False)
    message = str(e.value)
    assert message == (f"{tiny}: tensor fails its checksum ({tensor}); the file is corrupt, download or "
                       f"convert it again.")
    assert isinstance(e.value, FormatError)


def test_several_corrupt_tensors_are_all_named_in_file_order(tiny):
    flip_byte(tiny, "output", 5)
    flip_byte(tiny, "tok_embeddings", 7)
    with pytest.raises(IntegrityError, match=r"2 tensors fail their checksum \(tok_embeddings, output\)"):
        check_file(tiny, progress=False)


def test_padding_between_tensors_is_not_part_of_any_checksum(tiny):
    """Only tensor bytes are covered; a flipped padding byte is harmless and not reported."""
    with open_tinf(tiny) as f:
        infos = sorted((f.info(n) for n in f.names), key=lambda i: i.offset)
        gaps = [a.offset + a.nbytes for a, b in zip(infos, infos[1:]) if b.offset > a.offset + a.nbytes]
        assert gaps, "the sample file should have padding between some tensors"
        where = f.data_offset + gaps[0]
    with open(tiny, "r+b") as out:
        out.seek(where)
        out.write(b"\xff")
    assert check_file(tiny, progress=False) == len(TENSORS)


def test_tinyrun_info_check_names_the_corrupt_tensor(tmp_path, capsys):
    from tinyinfer.runtime.cli import main

    path = write_runnable_tinf(tmp_path / "r.tinf")
    with pytest.raises(SystemExit) as clean:
        main(["info", str(path), "--check"])
    out, _ = capsys.readouterr()
    assert clean.value.code == 0 and out.rstrip().endswith("checked 15 tensors: every checksum matches")
    flip_byte(path, "layers.1.wo", 123)
    with pytest.raises(SystemExit) as corrupt:
        main(["info", str(path), "--check"])
    _, err = capsys.readouterr()
    assert corrupt.value.code == 1
    assert err == (f"error: {path}: tensor fails its checksum (layers.1.wo); the file is corrupt, download or "
                   f"convert it again.\n")
    with pytest.raises(SystemExit) as unchecked:   # without --check the damage goes unnoticed: it is data
        main(["info", str(path)])
    assert unchecked.value.code == 0
