"""Nothing lost (issue 49): held-out stream rows stay out of training, eval forwards match across dp ranks,
and ``--overwrite`` replaces only a folder cuboid wrote."""
from __future__ import annotations

import json

import pytest
import torch

from .test_prepare_cmd import chat_file, qwen  # noqa: F401 (fixtures)
from .test_streaming import row_ids, rows_file, stream


@pytest.mark.parametrize("files", [2, 4], ids=["file-per-rank", "two-files-per-rank"])
def test_streamed_eval_rows_are_never_trained_on(tmp_path, files):
    """The first ``skip`` rows of the stream (in file order) are the eval rows: no dp rank reads them, and
    together the ranks read every other row once an epoch, however the files are dealt to the ranks."""
    paths = [rows_file(tmp_path / f"{i}.jsonl", 30, start=30 * i) for i in range(files)]
    n, skip = 30 * files, 40  # the held-out rows span the first file and a part of the second
    seen = []
    for rank in range(2):
        s = stream(paths, False, rank=rank, world=2, rows=1, skip=skip)
        seen.append([i for _ in range((n - skip) // 2) for i in row_ids(s.next())])
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(skip, n)), "eval rows trained on, or training rows never read"


def test_prepare_overwrite_replaces_only_a_folder_it_wrote(qwen, chat_file, tmp_path, monkeypatch, capsys):
    """``--output . --overwrite`` once moved the current directory (the data in it) away and deleted it."""
    from cuboid.cli import main

    work = tmp_path / "work"
    work.mkdir()
    data = work / "chat.jsonl"
    data.write_bytes(chat_file.read_bytes())
    monkeypatch.chdir(work)
    base = ["prepare", "--model", str(qwen), "--data", "chat.jsonl", "--max-length", "64", "--overwrite"]
    assert main([*base, "--output", "."]) == 2
    assert capsys.readouterr().err.strip() == ("cuboid prepare: error: refusing to replace --output .: it holds "
                                               "the current directory; choose another folder")
    assert data.read_bytes() == chat_file.read_bytes()
    mine = tmp_path / "mine"  # a user's folder: kept, whatever --overwrite says
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "a.txt").write_text("keep")
    assert main([*base, "--output", str(mine)]) == 2
    assert "cuboid prepare did not write it (notes/ is not part of a prepared folder" in capsys.readouterr().err
    assert (mine / "notes" / "a.txt").read_text() == "keep"
    assert main([*base, "--output", str(work / "inner"), "--data", str(data)]) == 0  # a prepared folder: replaced
    (work / "inner" / "extra.txt").write_text("x")  # ... unless something else was put in it
    assert main([*base, "--output", str(work / "inner")]) == 2
    assert "extra.txt is not part" in capsys.readouterr().err
    (work / "inner" / "extra.txt").unlink()
    assert main([*base, "--output", str(work / "inner"), "--max-length", "96"]) == 0
    assert json.loads((work / "inner" / "prepare_report.json").read_text())["max_length"] == 96
    assert main([*base, "--output", str(work), "--data", str(data)]) == 2  # the data's own folder


def test_resume_into_another_run_s_folder_is_refused(tmp_path):
    """``--resume A/checkpoint-N --output-dir B`` once replaced B's final/, cut its metrics and took its run
    record (B's ``--resume latest`` then went on with A's run)."""
    from cuboid.parallel import Mesh, Plan
    from cuboid.train.resume import RUN_FILE, check_output_dir

    mesh = Mesh.layout(Plan())
    a, b = tmp_path / "A", tmp_path / "B"
    (a / "checkpoint-2").mkdir(parents=True)
    (a / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"state": {"run_id": "aaaa"}}))
    (a / RUN_FILE).write_text(json.dumps({"run_id": "aaaa"}))
    b.mkdir()
    (b / RUN_FILE).write_text(json.dumps({"run_id": "bbbb"}))
    (b / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.name for p in b.iterdir())
    with pytest.raises(ValueError, match=r"--resume .*checkpoint-2 continues run aaaa, but --output-dir .*B holds "
                                         r"metrics.jsonl of run bbbb"):
        check_output_dir(b, str(a / "checkpoint-2"), False, mesh, 0)
    assert sorted(p.name for p in b.iterdir()) == before and (b / RUN_FILE).read_text() == '{"run_id": "bbbb"}'
    assert check_output_dir(b, str(a / "checkpoint-2"), True, mesh, 0) is None  # --overwrite-output-dir
    assert check_output_dir(a, str(a / "checkpoint-2"), False, mesh, 0) is None  # its own folder
    assert check_output_dir(tmp_path / "C", str(a / "checkpoint-2"), False, mesh, 0) is None  # a new folder


def test_a_rewind_starts_a_branch_that_leaves_the_abandoned_checkpoints_alone(tmp_path, capsys):
    """Resuming checkpoint-1 of a run that saved up to checkpoint-3 abandons 2 and 3: --keep pruned the
    rewind's own first, and --resume latest (or a restart) took the abandoned checkpoint-3 for this run's."""
    from cuboid.cli import main
    from cuboid.train.resume import folder_run_id, resolve_resume, run_id_of

    out = tmp_path / "run"
    common = ["finetune", "--model", "vit-debug", "--data", "digits", "--batch-size", "8", "--save-every", "1",
              "--output-dir", str(out), "--no-progress", "--no-plot", "--eval-every", "100"]
    assert main([*common, "--steps", "3", "--keep", "10"]) == 0
    first = folder_run_id(out)
    assert first and {run_id_of(out / f"checkpoint-{s}") for s in range(1, 4)} == {first}
    assert main([*common, "--steps", "2", "--keep", "1", "--resume", str(out / "checkpoint-1")]) == 0
    assert "a new branch of the run" in capsys.readouterr().err
    branch = folder_run_id(out)
    assert branch not in (None, first) and run_id_of(out / "checkpoint-2") == branch
    assert run_id_of(out / "checkpoint-3") == first and run_id_of(out / "checkpoint-1") == first  # left alone
    assert resolve_resume("latest", out, branch) == out / "checkpoint-2"  # not the abandoned checkpoint-3


def test_a_stream_resumed_over_changed_data_or_settings_is_refused(tmp_path):
    """A streamed run resumed after its file was cut or rewritten, or with another buffer or seed, went on
    silently on other rows."""
    from cuboid.data.formats import DataError

    data = rows_file(tmp_path / "rows.jsonl", 40)
    s = stream([data], False, skip=5)
    for _ in range(3):
        s.next()
    saved = json.loads(json.dumps(s.position))
    again = stream([data], False, skip=5)
    again.position = saved  # the same data and settings: resumes
    assert torch.equal(again.next()["input_ids"], s.next()["input_ids"])
    with pytest.raises(DataError, match="--shuffle-buffer 8, this run with 4"):
        stream([data], False, skip=5, buffer=4).position = saved
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:20]))  # cut to its first 20 rows
    with pytest.raises(DataError, match=r"rows.jsonl as it was: the file was \d+ bytes, now \d+ \(truncated or "
                                        r"rewritten\)"):
        stream([data], False, skip=5).position = saved


def test_finetune_on_a_prepared_folder_refuses_flags_it_cannot_apply(qwen, chat_file, tmp_path, capsys):  # noqa: F811
    """--seq-len, --train-on-prompt, --chat-template ... were silently ignored on a cuboid prepare folder."""
    from cuboid.cli import main

    out = tmp_path / "prepared"
    assert main(["prepare", "--model", str(qwen), "--data", str(chat_file), "--output", str(out),
                 "--max-length", "64"]) == 0
    capsys.readouterr()
    base = ["finetune", "--model", str(qwen), "--data", str(out), "--task", "sft", "--steps", "1", "--batch-size",
            "2", "--output-dir", str(tmp_path / "run"), "--no-progress", "--no-plot"]
    for flags, want in ((["--seq-len", "128"], "--seq-len 128 cannot apply to"),
                        (["--train-on-prompt"], "--train-on-prompt True cannot apply"),
                        (["--chat-template", str(chat_file)], "--chat-template")):
        assert main([*base, *flags]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(err) == 1 and want in err[0] and "run cuboid prepare again" in err[0], err
    assert main([*base, "--seq-len", "32"]) == 2
    assert "(made with --max-length 64, prepare_report.json)" in capsys.readouterr().err


def test_packed_rows_of_a_mixture_of_experts_keep_padding_out_of_the_balance_loss():
    """The trainer gave packed rows without their attention_mask, so the load-balancing loss counted the
    padding slots (a document of their own to the attention, tokens to the router)."""
    import cuboid
    from cuboid.data.formats import model_inputs
    from cuboid.data.packing import pack
    from cuboid.train.loop import routes

    model = cuboid.load("qwen3-moe-debug", seed=0).eval()
    docs = [list(range(5, 5 + n)) for n in (5, 4, 3)]
    rows = pack(docs, 16, labels=docs, pad_id=0)  # 12 tokens and 4 slots of padding
    assert int(rows["attention_mask"].sum()) == 12 and routes(model)
    with torch.no_grad():
        got = model(**model_inputs(rows, routes(model))).aux_loss
        want = model(**{k: v[:, :12] for k, v in rows.items() if k != "attention_mask"}).aux_loss
        dense = model_inputs(rows)  # a model without experts: the positions keep the padding apart
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert "attention_mask" not in dense
