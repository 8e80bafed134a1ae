"""`cuboid eval`: sliding-window perplexity equal to transformers' documented recipe on the same model and text."""
from __future__ import annotations

import pytest
import torch

import cuboid
from cuboid.cli.eval import perplexity, sliding_windows
from cuboid.kernels import use_backend

from . import fixtures as F
from .test_finetune import cli


def hf_recipe(model, ids: torch.Tensor, max_length: int, stride: int) -> float:
    """transformers' perplexity documentation, with each window weighted by the targets its loss averages."""
    nll, count, previous_end = 0.0, 0, 0
    for begin in range(0, ids.shape[1], stride):
        end = min(begin + max_length, ids.shape[1])
        target_len = end - previous_end
        window = ids[:, begin:end]
        labels = window.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(window, labels=labels).loss
        n = int((labels[:, 1:] != -100).sum())
        nll += float(loss) * n
        count += n
        previous_end = end
        if end == ids.shape[1]:
            break
    return torch.exp(torch.tensor(nll / count)).item()


def test_windows_cover_every_token_once():
    for n, m, s in ((100, 32, 16), (100, 32, 32), (31, 32, 8), (2, 2, 1)):
        w = sliding_windows(n, m, s)
        assert sum(scored for _, _, scored in w) == n and w[-1][1] == n
        assert all(end - begin <= m and scored <= end - begin for begin, end, scored in w)
    for bad in ((100, 1, 1), (100, 8, 9), (100, 8, 0), (1, 8, 4)):
        with pytest.raises(ValueError):
            sliding_windows(*bad)


@pytest.mark.parametrize("make", ["qwen2", "gpt2"])
def test_perplexity_equals_transformers_recipe_and_the_cli_prints_it(make, tmp_path):
    import transformers as T

    folder = (F.hf_qwen2_folder if make == "qwen2" else F.hf_gpt2_folder)(tmp_path / make)
    text = " ".join(t for t, _ in F.sentences(16, seed=4))
    (tmp_path / "held.txt").write_text(text)
    tok = T.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] > 64 * 2
    hf = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = cuboid.load(folder)
    for max_length, stride in ((32, 16), (64, 24)):
        want = hf_recipe(hf, ids, max_length, stride)
        with use_backend("torch"):  # the CPU path a user runs (this process has the Triton interpreter on)
            got = perplexity(ours, ids, max_length, stride)["perplexity"]
        assert abs(got - want) <= 1e-4 * want, (max_length, stride, got, want)
    rc, out, err = cli("eval", "--model", str(folder), "--data", str(tmp_path / "held.txt"), "--max-length", "32",
                       "--stride", "16", "--no-progress")
    assert rc == 0, err
    printed = float(out.rsplit("perplexity ", 1)[1])
    assert abs(printed - hf_recipe(hf, ids, 32, 16)) <= 1e-4 * printed, out


def test_eval_errors_are_one_line(tmp_path, capsys):
    from cuboid.cli import main

    folder = F.hf_bert_folder(tmp_path / "bert", head="mlm")
    (tmp_path / "t.txt").write_text("a few words of text " * 20)
    assert main(["eval", "--model", str(folder), "--data", str(tmp_path / "t.txt")]) == 2
    assert "perplexity needs a causal LM head" in capsys.readouterr().err
    assert main(["eval", "--model", "gpt-debug", "--data", str(tmp_path / "t.txt")]) == 2
    assert "no tokenizer for gpt-debug" in capsys.readouterr().err
