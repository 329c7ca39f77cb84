"""LongBench metrics on hand-made vectors (values worked out by hand)."""

from __future__ import annotations

import math

import pytest

from eval.longbench import metrics as m


def test_normalize_answer_drops_case_punctuation_articles():
    assert m.normalize_answer("The  Cat, a dog; AN owl!") == "cat dog owl"
    assert m.normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_normalize_zh_answer():
    assert m.normalize_zh_answer("你好， 世界！A b") == "你好世界ab"


def test_qa_f1_score():
    assert m.qa_f1_score("Paris", "paris") == 1.0
    assert m.qa_f1_score("the city of Paris", "Paris") == pytest.approx(
        2 * (1 / 3) * 1 / (1 / 3 + 1)
    )
    assert m.qa_f1_score("London", "Paris") == 0.0
    assert m.qa_f1_score("", "Paris") == 0.0
    # repeated tokens count as a multiset: pred "a b b" vs gold "b b c" share two
    assert m.qa_f1_score("x y y", "y y z") == pytest.approx(2 / 3)


def test_qa_f1_zh_score():
    assert m.qa_f1_zh_score("北京", "北京") == 1.0
    assert m.qa_f1_zh_score("上海", "北京") == 0.0


def test_rouge_score():
    assert m.rouge_score("the cat sat", "the cat sat") == pytest.approx(1.0)
    # LCS("a b c d", "a c e") = 2: P = 2/4, R = 2/3, F = 4/7
    assert m.rouge_score("a b c d", "a c e") == pytest.approx(4 / 7)
    assert m.rouge_score("", "a b") == 0.0


def test_rouge_zh_score():
    assert m.rouge_zh_score("今天天气很好", "今天天气很好") == pytest.approx(1.0)
    assert 0.0 < m.rouge_zh_score("今天天气很好", "今天天气不好") < 1.0


def test_classification_score():
    classes = ["Location", "Human being", "Entity", "Animal"]
    assert m.classification_score("Location", "Location", all_classes=classes) == 1.0
    assert m.classification_score("Location or Entity", "Location", all_classes=classes) == 0.5
    assert m.classification_score("Animal", "Location", all_classes=classes) == 0.0
    # a matched class that is a strict substring of the gold class is not counted
    sub = ["Human", "Human being"]
    assert m.classification_score("Human being", "Human being", all_classes=sub) == 1.0


def test_retrieval_scores():
    assert m.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval_score("Paragraph 3 or 4", "Paragraph 3") == 0.5
    assert m.retrieval_score("no idea", "Paragraph 3") == 0.0
    assert m.retrieval_zh_score("段落7", "段落7") == 1.0
    assert m.retrieval_zh_score("段落7和段落2", "段落7") == 0.5


def test_count_score():
    assert m.count_score("There are 5 passages", "5") == 1.0
    assert m.count_score("5 or 6", "5") == 0.5
    assert m.count_score("five", "5") == 0.0


def test_code_sim_score_uses_first_plain_line():
    pred = "\n```python\n# comment\nreturn x + 1\nmore"
    assert m.code_sim_score(pred, "return x + 1") == 1.0
    assert m.code_sim_score("abcd", "abce") == pytest.approx(0.75)


def test_substring_match_score():
    assert m.substring_match_score("The code is 4817.", "4817") == 1.0
    assert m.substring_match_score("The code is 4818.", "4817") == 0.0


def test_score_item_max_over_answers_and_first_line():
    assert m.score_item("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    # triviaqa keeps only the first line of the prediction
    assert m.score_item("triviaqa", "Paris\nLondon London", ["Paris"]) == 1.0
    assert m.score_item("hotpotqa", "Paris\nLondon London", ["Paris"]) < 1.0
    assert m.score_item("trec", "Location", ["Location"], ["Location", "Entity"]) == 1.0
    with pytest.raises(ValueError):
        m.metric_for("no_such_task")
    assert m.metric_for("hotpotqa_e") is m.qa_f1_score


def test_task_and_category_scores():
    assert m.task_score([1.0, 0.0, 0.5]) == 50.0
    assert m.task_score([]) == 0.0
    cats = m.category_scores({"qasper": 40.0, "narrativeqa": 20.0, "hotpotqa": 60.0})
    assert cats["single-doc QA"] == 30.0
    assert cats["multi-doc QA"] == 60.0
    assert math.isclose(cats["overall"], 40.0)
