"""Built-in rule-based scorers (GSM8K, MATH, arithmetic) and their dispatch by data source."""

import pytest

from hflow.reward.score import SCORERS, arithmetic, default_compute_score, gsm8k, math

# ---- GSM8K ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("She pays 3 * 24 = 72 dollars.\n#### 72", 1.0),
        ("#### 1,234", 1.0),  # ground truth 1234 below for this one
        ("The answer is #### 72.", 1.0),
        ("#### $72", 1.0),
        ("#### 72.0", 1.0),
        ("First guess #### 10, corrected: #### 72", 0.0),  # two different answers pay nothing (reward audit)
        ("#### 72\n#### 72", 1.0),  # the same answer twice is one answer
        ("#### 72 or 73", 0.0),  # several candidates after the marker
        ("#### ７２", 0.0),  # fullwidth digits are not an answer
        ("The answer is 72", 0.0),  # strict: no ####
        ("#### 71", 0.0),
    ],
)
def test_gsm8k_strict(response, expected):
    ground_truth = "1234" if "1,234" in response else "72"
    assert gsm8k.compute_score(response, ground_truth) == expected


def test_gsm8k_flexible_format_score_and_extraction():
    assert gsm8k.compute_score("so 3 + 4 = 7 apples", "7", method="flexible") == 1.0
    assert gsm8k.compute_score("no numbers at all", "7", method="flexible") == 0.0
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("8", "7", format_score=0.1) == 0.0  # no answer: not even the format score
    assert gsm8k.compute_score("#### -5", -5) == 1.0
    for fraction in ("#### 1/2", "#### \\frac{1}{2}", "#### 0.50"):  # equivalent spellings of 0.5
        assert gsm8k.compute_score(fraction, "0.5") == 1.0, fraction
    assert gsm8k.extract_solution("x #### 1,000,000") == "1000000"
    assert gsm8k.extract_solution("nothing") is None
    with pytest.raises(ValueError, match="method='fuzzy'"):
        gsm8k.extract_solution("#### 1", method="fuzzy")


# ---- MATH ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "ground_truth"),
    [
        (r"\frac{1}{2}", r"\frac12"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", r"3/4"),
        (r"0.5", r"\frac{1}{2}"),
        (r".5", r"0.5"),
        (r"\left( 1, 2 \right)", r"(1,2)"),
        (r"5 \text{ cm}", r"5"),
        (r"90^\circ", r"90"),
        (r"90^{\circ}", r"90"),
        (r"50\%", r"50"),
        (r"\$5", r"5"),
        (r"x = 3", r"3"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"2\!\sqrt{2}", r"2\sqrt{2}"),
        (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}"),
        # plain numbers compare by value (the reward audit found these rejected)
        (r"0.25", r"\frac14"),
        (r"17.0", r"17"),
        (r"17.", r"17"),
        (r"9/2", r"4.5"),
        (r"1,024", r"1024"),
        (r"-0.5", r"-\frac{1}{2}"),
    ],
)
def test_math_equivalent_answers(answer, ground_truth):
    assert math.compute_score(f"We get \\boxed{{{answer}}}.", ground_truth) == 1.0


@pytest.mark.parametrize(
    ("answer", "ground_truth"),
    [
        (r"x + y = 3", r"3"),  # a real equation keeps its left side
        (r"\frac{1}{3}", r"\frac{1}{2}"),
        (r"2", r"3"),
    ],
)
def test_math_different_answers(answer, ground_truth):
    assert math.compute_score(f"\\boxed{{{answer}}}", ground_truth) == 0.0


def test_math_boxed_extraction():
    assert math.last_boxed_only_string(r"first \boxed{1} then \boxed{\frac{2}{3}} end") == r"\boxed{\frac{2}{3}}"
    assert math.last_boxed_only_string(r"$\boxed 7$ more") == r"\boxed 7"
    assert math.last_boxed_only_string(r"\fbox{9}") == r"\fbox{9}"
    assert math.last_boxed_only_string(r"\boxed{unclosed") is None
    assert math.last_boxed_only_string("no box") is None
    assert math.remove_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert math.remove_boxed(r"\boxed 7") == "7"
    assert math.compute_score(r"$\boxed 7$", "7") == 1.0
    assert math.compute_score("The answer is 7", "7") == 0.0
    assert math.compute_score(r"\boxed{6} \boxed{7}", "7") == 0.0  # several different answers
    assert math.compute_score(r"\boxed{7}, so \boxed{7.0}", "7") == 1.0
    assert math.compute_score(r"\boxed{unclosed", "unclosed") == 0.0
    # A ground truth given as a full solution is reduced to its boxed answer.
    assert math.compute_score(r"\boxed{4}", r"So $2 + 2 = \boxed{4}$.") == 1.0
    assert math.is_equiv(None, None) and not math.is_equiv("1", None)


# ---- arithmetic (built-in task) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("Answer: 42", "42", 1.0),
        ("answer:-7", "-7", 1.0),
        ("ANSWER: 1,024", 1024, 1.0),
        ("3 + 4 = 7", "7", 1.0),  # no marker: the last integer
        ("Answer: 5. Check: 2 + 3 = 5, not 6", "5", 1.0),  # the marker wins over later numbers
        ("Answer: 5 Answer: 6", "6", 1.0),  # the last marker wins
        ("10-3", "3", 1.0),  # a minus after a digit is an operator
        ("10 - -3 = 13", "13", 1.0),
        ("Answer: 42.0", "42", 1.0),
        ("Answer: 3.5", "3", 0.0),
        ("Answer: 41", "42", 0.0),
        ("I don't know", "42", 0.0),
        ("", "0", 0.0),
    ],
)
def test_arithmetic(response, ground_truth, expected):
    assert arithmetic.compute_score(response, ground_truth) == expected


def test_arithmetic_extract_and_bad_ground_truth():
    assert arithmetic.extract_answer("The sum is -12") == -12
    assert arithmetic.extract_answer("nothing") is None
    with pytest.raises(ValueError, match=r"ground_truth='forty'"):
        arithmetic.compute_score("Answer: 40", "forty")


# ---- dispatch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data_source", "response", "ground_truth"),
    [
        ("openai/gsm8k", "#### 72", "72"),
        ("lighteval/MATH", r"\boxed{\frac{1}{2}}", "0.5"),
        ("DigitalLearningGmbH/MATH-lighteval", r"\boxed{3}", "3"),
        ("HuggingFaceH4/MATH-500", r"\boxed{3}", "3"),
        ("hflow/arithmetic", "Answer: 3", "3"),
    ],
)
def test_default_compute_score_dispatch(data_source, response, ground_truth):
    score = default_compute_score(data_source, response, ground_truth, extra_info={"index": 0})
    assert score == 1.0 and isinstance(score, float)
    assert default_compute_score(data_source, "nothing useful", ground_truth) == 0.0


def test_unknown_data_source_names_it_and_the_fix():
    with pytest.raises(ValueError) as error:
        default_compute_score("my/dataset", "#### 1", "1")
    message = str(error.value)
    assert "'my/dataset'" in message and "custom_reward_function.path" in message
    assert all(known in message for known in SCORERS)
