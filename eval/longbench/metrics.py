"""LongBench (v1) metrics, written here from their published semantics.

Every metric has LongBench's signature ``metric(prediction, ground_truth, **kwargs) -> float`` in
[0, 1], scores one prediction against one gold answer, and keeps LongBench's name. A task score is
100 x the mean over items of the max over that item's gold answers (:func:`score_item`,
:func:`task_score`); four few-shot tasks first cut the prediction to its first line.

Deviations, all deliberate and small:

- ``rouge_score`` is ROUGE-L F from the ``rouge-score`` package (LongBench used the ``rouge``
  package; both compute LCS-based F over tokens, the tokenisation differs slightly: here English
  is lower-cased and split on non-alphanumerics, Chinese is jieba-cut and split on spaces).
- ``classification_score`` drops every matched class that is a strict substring of the gold class;
  upstream removes from the list it iterates over, which can skip an element.

``substring_match_score`` is *not* a LongBench metric: it is used for the offline needle set, where
the answer is a short code that a small model often wraps in a sentence.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lower-case, drop ASCII and Chinese punctuation, remove all whitespace."""
    drop = set(string.punctuation + ZH_PUNCTUATION)
    return "".join(ch for ch in s.lower() if ch not in drop and not ch.isspace())


def f1_tokens(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Token-multiset F1 between two token lists (0 when nothing is shared)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_tokens(text: str) -> list[str]:
    import jieba

    out = (normalize_zh_answer(t) for t in jieba.cut(text, cut_all=False))
    return [t for t in out if t]


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    return f1_tokens(_jieba_tokens(prediction), _jieba_tokens(ground_truth))


class _SpaceTokenizer:
    """rouge-score tokenizer for pre-segmented (jieba) text: split on whitespace only."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        return text.split()


def _rouge_l(prediction: str, ground_truth: str, tokenizer: object | None) -> float:
    from rouge_score import rouge_scorer

    if not prediction.strip() or not ground_truth.strip():
        return 0.0
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=tokenizer)
    return float(scorer.score(ground_truth, prediction)["rougeL"].fmeasure)


def rouge_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    return _rouge_l(prediction, ground_truth, None)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    import jieba

    pred = " ".join(jieba.cut(prediction, cut_all=False))
    gold = " ".join(jieba.cut(ground_truth, cut_all=False))
    return _rouge_l(pred, gold, _SpaceTokenizer())


def classification_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """1/m when the gold class is among the m classes named in the prediction, else 0."""
    all_classes = kwargs.get("all_classes") or []
    matched = [c for c in all_classes if c in prediction]  # type: ignore[union-attr]
    matched = [c for c in matched if not (c in ground_truth and c != ground_truth)]
    return 1.0 / len(matched) if ground_truth in matched else 0.0


def _retrieval(prediction: str, ground_truth: str, pattern: str) -> float:
    found = re.findall(pattern, ground_truth)
    if not found:
        return 0.0
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == found[0] for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    return _retrieval(prediction, ground_truth, r"Paragraph (\d+)")


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    return _retrieval(prediction, ground_truth, r"段落(\d+)")


def count_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == str(ground_truth) for n in numbers) / len(numbers)


def code_sim_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """Fuzzy similarity of the first code line (no backticks, ``#`` or ``//``) to the gold."""
    from rapidfuzz import fuzz

    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz.ratio(line, ground_truth) / 100


def substring_match_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """1 when the normalised gold answer occurs in the normalised prediction (not LongBench)."""
    gold = normalize_answer(ground_truth)
    return float(bool(gold) and gold in normalize_answer(prediction))


Metric = Callable[..., float]

DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

CATEGORIES: dict[str, tuple[str, ...]] = {
    "single-doc QA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "multi-doc QA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "few-shot": ("trec", "triviaqa", "samsum", "lsht"),
    "synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "code": ("lcc", "repobench-p"),
}


def metric_for(dataset: str) -> Metric:
    """The metric of a LongBench task (``_e`` variants share their task's metric)."""
    name = dataset.removesuffix("_e")
    if name not in DATASET2METRIC:
        raise ValueError(f"no metric for dataset {dataset!r}")
    return DATASET2METRIC[name]


def score_item(
    dataset: str,
    prediction: str,
    answers: Sequence[str],
    all_classes: Sequence[str] | None = None,
    metric: Metric | None = None,
) -> float:
    """One item's score in [0, 1]: the max over its gold answers, LongBench post-processing."""
    if dataset.removesuffix("_e") in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = metric or metric_for(dataset)
    return max((fn(prediction, gold, all_classes=all_classes) for gold in answers), default=0.0)


def task_score(item_scores: Sequence[float]) -> float:
    """LongBench's task score: 100 x the mean item score, rounded to two decimals."""
    return round(100 * sum(item_scores) / len(item_scores), 2) if item_scores else 0.0


def category_scores(task_scores: dict[str, float]) -> dict[str, float]:
    """Mean task score per LongBench category present, and ``overall`` = mean over all tasks."""
    out = {}
    for cat, tasks in CATEGORIES.items():
        present = [task_scores[t] for t in tasks if t in task_scores]
        if present:
            out[cat] = round(sum(present) / len(present), 2)
    if task_scores:
        out["overall"] = round(sum(task_scores.values()) / len(task_scores), 2)
    return out
