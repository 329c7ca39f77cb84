"""The evaluation-set guard's n-gram containment test."""

from d3d.training.contamination import EvalIndex

ITEM = (
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
    "muffins for her friends every day with four. She sells the remainder at the farmers' market "
    "daily for $2 per fresh duck egg. How much in dollars does she make every day at the market?"
)
SHORT = "Compose an engaging travel blog post about a recent trip to Hawaii."


def test_an_item_inside_a_prompt_is_found_even_reformatted():
    index = EvalIndex([("gsm8k", ITEM), ("mtbench", SHORT)])
    assert index.sets == ["gsm8k", "mtbench"] and len(index) == 2
    assert index.match(f"Please solve:\n\n{ITEM}\nAnswer with a number.") == "gsm8k"
    assert index.match(ITEM.upper().replace(".", " .")) == "gsm8k"
    assert index.match(f"Task: {SHORT} Keep it short.") == "mtbench"


def test_shared_phrases_are_not_an_item():
    index = EvalIndex([("gsm8k", ITEM), ("mtbench", SHORT)])
    assert index.match("How much in dollars does she make every day at the market?") is None
    assert index.match("Write a travel blog post about Hawaii.") is None
    half = " ".join(ITEM.split()[: len(ITEM.split()) // 3])
    assert index.match(half) is None
    assert EvalIndex([]).match(ITEM) is None
