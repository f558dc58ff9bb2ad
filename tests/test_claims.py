"""dtlib.claims: a lesson's sentence holds on this run's numbers, or the build fails quoting it."""
import pytest

from dtlib.claims import ClaimError, claim


def test_a_true_claim_prints_one_line_with_its_values(capsys):
    claim(0.36 >= 0.34, "HFU >= MFU", MFU="34%", HFU="36%")
    assert capsys.readouterr().out == "✓ HFU >= MFU (MFU 34%, HFU 36%)\n"


def test_a_false_claim_quotes_the_sentence_and_the_numbers():
    with pytest.raises(ClaimError, match=r"the lesson says: 'HFU >= MFU', but this run disagrees \(MFU 34%, HFU 31%\)"):
        claim(0.31 >= 0.34, "HFU >= MFU", MFU="34%", HFU="31%")
    assert issubclass(ClaimError, AssertionError)  # nbval and pytest report it as a failure


def test_a_claim_needs_its_sentence():
    with pytest.raises(ValueError, match="sentence"):
        claim(True, " ")
