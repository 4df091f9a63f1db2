"""A ~3 s run of the codec fuzzer (tests/fuzz_codec.py), in process, without Ray."""

from __future__ import annotations

from fuzz_codec import ALLOWED, main


def test_three_seconds_of_fuzzing_find_no_unexpected_outcome() -> None:
    result = main(["--seconds", "3", "--seed", "1234"])
    assert result.inputs > 100, result.report()
    assert result.n_unexpected == 0, result.report()
    targets = {key.split(":", 1)[0] for key in result.counts}
    assert targets == {"codec", "disk", "redis"}, result.report()
    assert all(key.split(":", 1)[1] in ALLOWED for key in result.counts), result.report()
    # The mutations reach past the checksums: some inputs are rejected, some decode.
    assert result.counts["codec:payload_error"] > 0 and result.counts["codec:ok"] > 0
