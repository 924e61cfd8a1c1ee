"""Scores of generated answers against references: exact match, BLEU-4 and ROUGE-L.

Text is split into words, except CJK characters, which count one each (as Chinese ROUGE/BLEU do).
"""

from __future__ import annotations

import re

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_TOKEN = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")


def tokens(text: str) -> list[str]:
    """Words, with each CJK character a word of its own."""
    return _TOKEN.findall(text)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1: longest common subsequence of tokens."""
    pred, ref = tokens(prediction), tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    previous = [0] * (len(ref) + 1)
    for p in pred:
        current = [0]
        for j, r in enumerate(ref, start=1):
            current.append(previous[j - 1] + 1 if p == r else max(previous[j], current[j - 1]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def score_predictions(predictions: list[str], references: list[str]) -> dict[str, float]:
    """predict_exact_match, predict_bleu-4 (sacrebleu, corpus level) and predict_rouge-l, each in [0, 1]."""
    import sacrebleu

    count = max(len(references), 1)
    exact = sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / count
    spaced = [" ".join(tokens(t)) for t in predictions], [" ".join(tokens(t)) for t in references]
    bleu = sacrebleu.corpus_bleu(spaced[0], [spaced[1]], tokenize="none").score / 100 if references else 0.0
    rouge = sum(rouge_l(p, r) for p, r in zip(predictions, references)) / count
    return {"predict_exact_match": round(exact, 4), "predict_bleu-4": round(bleu, 4), "predict_rouge-l": round(rouge, 4)}
