"""Known-answer cases per task, answer extraction, and the Countdown parser's limits (in-process)."""
import pytest

from megatron_rl.rewards import REWARDS, get_reward_fn
from megatron_rl.rewards.countdown import CountdownSyntaxError, check_countdown, evaluate_equation, score_countdown
from megatron_rl.rewards.extract import last_answer_tag, last_boxed, last_choice_letter, last_number


def test_registry_lists_tasks_and_rejects_unknown():
    assert set(REWARDS) >= {"math", "countdown", "mmlu", "gsm8k", "arithmetic"}
    with pytest.raises(ValueError, match="valid tasks"):
        get_reward_fn("chess")


@pytest.mark.parametrize("text, expected", [
    (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{x^{2}+\{y\}}", r"x^{2}+\{y\}"),
    (r"\fbox{7}", "7"),
    (r"\boxed 5$", "5"),
    (r"\boxed{a\\}", "a\\\\"),
    (r"\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_other_extractors():
    assert last_answer_tag("<answer>1</answer> and <ANSWER> 2+3 </answer>") == "2+3"
    assert last_answer_tag("<answer>unclosed") is None
    assert last_choice_letter("A is wrong; the answer is (C).") == "C"
    assert last_choice_letter("ANSWER: B") == "B"
    assert last_choice_letter("The answer is a function of C. So B") == "B"
    assert last_choice_letter(r"\boxed{D}") == "D"
    assert last_choice_letter("A cat sat. I pick B") == "B"
    assert last_choice_letter("Always Excellent") is None
    assert last_number("It costs $1,234.50, not 7.") == "7"
    assert last_number("x = -3/4") == "-3/4"
    assert last_number("none") is None


@pytest.mark.parametrize("response, gold, expected", [
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac12", 1.0),
    (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{2}", "3", 0.0),
    ("the answer is 1/2", "0.5", 0.0),  # no \boxed{}: no answer
])
def test_math_known_answers(response, gold, expected):
    assert get_reward_fn("math")(response, gold, {}) == expected


def test_countdown_known_answers():
    meta = {"numbers": [3, 5, 7, 7], "target": 22}
    cd = get_reward_fn("countdown")
    assert cd("work...<answer>(3 + 5) * 2</answer>", "16", {"numbers": [3, 5, 2]}) == 1.0
    assert cd("<answer>3*5 + 7</answer>", "22", meta) == 1.0  # not all numbers used: allowed
    assert cd("<answer>3*5 + 7 = 22</answer>", "22", meta) == 1.0  # tolerated "= target"
    assert cd("<answer>3*5 + 7 = 23</answer>", "22", meta) == 0.0
    assert cd("<answer>7 + 7 + 5 + 3</answer>", "22", meta) == 1.0  # 7 given twice, used twice
    assert cd("<answer>5*5 - 3</answer>", "22", meta) == 0.0  # 5 reused
    assert cd("<answer>11 * 2</answer>", "22", meta) == 0.0  # unknown numbers
    assert cd("<answer>3 * 5 + 5</answer>", "22", meta) == 0.0  # wrong value / reuse
    assert cd("3*5 + 7", "22", meta) == 0.0  # no tags
    assert cd("<answer>7 / (5 - 5)</answer>", "22", meta) == 0.0  # division by zero
    assert cd("<answer>(7 - 3) / 5 * 7 * 5 + 7 - 1</answer>", "22", {"numbers": [7, 3, 5, 7, 5, 7, 1]}) == 0.0
    # exact fractions: 7 / (3 - 5/2) = 14, no float rounding
    assert check_countdown("7 / (3 - 5/2)", [7, 3, 5, 2], 14)
    assert not check_countdown("1 / 3 * 3", [1, 3, 4], 1)  # 3 used twice
    assert check_countdown("-50 + (84*(26 + 2) + 83)/5", [50, 84, 26, 2, 83, 5], 437)  # reasoning-gym style


def test_countdown_require_all_and_format_reward():
    meta = {"numbers": [3, 5, 7], "target": 22}
    assert score_countdown("<answer>3*5+7</answer>", "22", meta, require_all=True).reward == 1.0
    assert score_countdown("<answer>5*5-3</answer>", "22", {"numbers": [5, 5, 3], "target": 22},
                           require_all=True).reward == 1.0
    assert score_countdown("<answer>3*7+1</answer>", "22", {"numbers": [3, 7, 1, 5]}, require_all=True).reward == 0.0
    assert score_countdown("<answer>3+5</answer>", "22", meta, format_reward=0.1).reward == 0.1
    assert score_countdown("<answer>3+</answer>", "22", meta, format_reward=0.1).reward == 0.0
    assert score_countdown("<answer>3+5</answer>", "22", meta).reward == 0.0
    assert score_countdown("<answer>1</answer>", "22", {}).reason == "error"  # no numbers


@pytest.mark.parametrize("answer", [
    "__import__('os').system('true')", "eval('1')", "9**9**9**9", "2^3", "-" * 40 + "3", "1.5 * 2", "+3",
    "(" * 40 + "1" + ")" * 40, "1" * 13, "1 +" * 200 + "1", "abs(3)", "3 5", "",
])
def test_countdown_grammar_rejects(answer):
    with pytest.raises(CountdownSyntaxError):
        evaluate_equation(answer)


def test_mmlu_and_numeric_known_answers():
    mmlu = get_reward_fn("mmlu")
    meta = {"choices": ["w", "x", "y", "z"]}
    assert mmlu("Thinking... Answer: C", "C", meta) == 1.0
    assert mmlu("The answer is (B)", "B", meta) == 1.0
    assert mmlu("Answer: A", "C", meta) == 0.0
    assert mmlu("I cannot tell", "C", meta) == 0.0
    gsm = get_reward_fn("gsm8k")
    assert gsm("She makes 9 * 2 = $18 every day. The answer is 18.", "18", {}) == 1.0
    assert gsm("Total: 1,000 apples", "1000", {}) == 1.0
    assert gsm("so 18.0", "18", {}) == 1.0
    assert gsm("so 17", "18", {}) == 0.0
    assert get_reward_fn("arithmetic")("-4", "-4", {}) == 1.0
    assert get_reward_fn("arithmetic")("= 106475279601", "106475279601", {}) == 1.0
