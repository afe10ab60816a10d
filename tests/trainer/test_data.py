from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sftjob_contract.config import DataConfig
from sftjob_trainer.data import IGNORE, SampleBuilder, SFTDataset
from sftjob_trainer.batching import GlobalBatches, collate
from sftjob_trainer.errors import InvalidData

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets / "model")


def write(tmp_path: Path, rows, name="d.parquet", schema=None) -> str:
    path = tmp_path / name
    table = (pa.Table.from_pylist(rows, schema=schema) if rows or schema is None
             else pa.Table.from_pylist([], schema=schema))
    pq.write_table(table, path)
    return str(path)


def cfg(files, **kw) -> DataConfig:
    return DataConfig(train_files=files, **kw)


def trained_text(tok, sample) -> list[str]:
    return tok.convert_ids_to_tokens([t for t in sample.targets if t != IGNORE])


def test_single_turn_trains_on_response_and_eos_only(tmp_path, tok):
    f = write(tmp_path, [{"prompt": "what color is the kiwi ?", "response": "the kiwi is teal ."}])
    ds = SFTDataset([f], SampleBuilder(tok, cfg([f])), "train")
    s = ds.sample(0)
    assert trained_text(tok, s) == ["the", "kiwi", "is", "teal", ".", "</s>"]
    assert s.targets[-1] == IGNORE and len(s.targets) == len(s.input_ids)


def test_chat_trains_on_every_assistant_turn(tmp_path, tok):
    messages = [
        {"role": "system", "content": "answer briefly ."},
        {"role": "user", "content": "what comes after one ?"},
        {"role": "assistant", "content": "after one comes two ."},
        {"role": "user", "content": "what comes after two ?"},
        {"role": "assistant", "content": "after two comes three ."},
    ]
    f = write(tmp_path, [{"messages": messages}])
    ds = SFTDataset([f], SampleBuilder(tok, cfg([f], messages_key="messages")), "train")
    got = trained_text(tok, ds.sample(0))
    assert got == "after one comes two . </s> after two comes three . </s>".split()


def test_truncation_policies_and_drop_counts(tmp_path, tok):
    rows = [{"prompt": "what color is the kiwi ?" * 3, "response": "the kiwi is teal ."},
            {"prompt": "hi", "response": "the kiwi is teal ."}]
    f = write(tmp_path, rows)
    with pytest.raises(InvalidData, match=r"row 0: \d+ tokens exceed data.max_length=12"):
        SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=12)), "train")
    left = SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=12, truncation="left")), "train")
    assert left.stats.truncated == 1 and left.stats.usable == 2
    assert trained_text(tok, left.sample(0))[-1] == "</s>"
    right = SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=12, truncation="right")), "train")
    # Cutting the end of row 0 leaves only prompt tokens: dropped and counted, not trained on.
    assert right.stats.dropped_no_target == 1 and right.stats.usable == 1
    assert list(right.valid) == [1]


def test_missing_column_is_named(tmp_path, tok):
    f = write(tmp_path, [{"question": "a", "response": "b"}])
    with pytest.raises(InvalidData, match=r"missing column\(s\) prompt \(has: question, response\)"):
        SFTDataset([f], SampleBuilder(tok, cfg([f])), "train")


def test_empty_file(tmp_path, tok):
    schema = pa.schema([("prompt", pa.string()), ("response", pa.string())])
    f = write(tmp_path, [], schema=schema)
    with pytest.raises(InvalidData, match="has no rows"):
        SFTDataset([f], SampleBuilder(tok, cfg([f])), "train")


def test_not_parquet(tmp_path, tok):
    f = tmp_path / "x.parquet"
    f.write_text("hello")
    with pytest.raises(InvalidData, match="not a readable parquet file"):
        SFTDataset([str(f)], SampleBuilder(tok, cfg([str(f)])), "train")


def test_missing_file_names_its_spec_field(tmp_path, tok):
    f = write(tmp_path, [{"prompt": "p", "response": "r"}])
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(InvalidData, match=rf"^spec.data.trainFiles\[1\] {missing}: data file does not exist$"):
        SFTDataset([f, missing], SampleBuilder(tok, cfg(["x"])), "train")
    with pytest.raises(InvalidData, match=r"^spec.data.valFiles\[0\] .*nope.parquet: data file does not exist"):
        SFTDataset([missing], SampleBuilder(tok, cfg(["x"])), "val")


def corrupt_row_group(path: str, rg: int) -> None:
    """Overwrite the page header at the start of row group ``rg``'s first column chunk."""
    col = pq.ParquetFile(path).metadata.row_group(rg).column(0)
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(b"\xff" * 24)


def test_corrupt_row_group_is_invalid_data_naming_file_and_row_group(tmp_path, tok):
    f = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(6)], "response": ["r"] * 6}), f, row_group_size=2)
    corrupt_row_group(f, 1)
    with pytest.raises(InvalidData, match=rf"^spec.data.trainFiles\[0\] {f}: row group 1 is corrupt"):
        SFTDataset([f], SampleBuilder(tok, cfg([f])), "train")


def test_wrong_column_type(tmp_path, tok):
    f = write(tmp_path, [{"prompt": 3, "response": "b"}])
    with pytest.raises(InvalidData, match="column 'prompt' must hold strings, got int"):
        SFTDataset([f], SampleBuilder(tok, cfg([f])), "train")


def test_malformed_messages(tmp_path, tok):
    f = write(tmp_path, [{"messages": [{"role": "user"}]}])
    with pytest.raises(InvalidData, match="string 'role' and 'content'"):
        SFTDataset([f], SampleBuilder(tok, cfg([f], messages_key="messages")), "train")


def test_no_trainable_tokens(tmp_path, tok):
    f = write(tmp_path, [{"prompt": "what color is the kiwi ?" * 4, "response": "x"}] * 3)
    with pytest.raises(InvalidData, match=r"no trainable tokens: all 3 rows were dropped; spec.data.maxLength \(8\) "
                                          "is too small for the data"):
        SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=8, truncation="right")), "train")


def test_no_trainable_tokens_from_empty_responses_does_not_blame_max_length(tmp_path, tok):
    f = write(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}] * 2)
    with pytest.raises(InvalidData, match=r"all 2 rows were dropped; every response is empty") as err:
        SFTDataset([f], SampleBuilder(tok, cfg([f], messages_key="messages")), "train")
    assert "maxLength" not in str(err.value)


def test_directory_and_glob(tmp_path, tok):
    rows = [{"prompt": "p", "response": "the kiwi ."}]
    write(tmp_path, rows, "a.parquet")
    write(tmp_path, rows * 2, "b.parquet")
    assert SFTDataset([str(tmp_path)], SampleBuilder(tok, cfg(["x"])), "t").rows.num_rows == 3
    assert SFTDataset([str(tmp_path / "b*.parquet")], SampleBuilder(tok, cfg(["x"])), "t").rows.num_rows == 2


def test_close_releases_files_and_reads_reopen_them(tmp_path, tok):
    f = write(tmp_path, [{"prompt": "p", "response": "the kiwi ."}, {"prompt": "q", "response": "the fig ."}])
    ds = SFTDataset([f], SampleBuilder(tok, cfg([f])), "t")
    before = ds.sample(1)
    handle = ds.rows._handles[0]
    ds.close()
    assert ds.rows._handles == {} and ds.rows._cache is None
    assert handle.closed
    assert ds.sample(1) == before  # a closed dataset still answers, by reopening


class DictCache(dict):
    def get(self, name):  # the ScanCache protocol
        return dict.get(self, name)

    def put(self, name, data):
        self[name] = data


def test_scan_cache_is_reused_until_data_or_settings_change(tmp_path, tok, monkeypatch):
    rows = [{"prompt": f"p{i}", "response": "the kiwi is teal ." * (i % 3 + 1)} for i in range(10)]
    f = write(tmp_path, rows)
    cache = DictCache()
    first = SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=12, truncation="right")), "t", cache=cache)
    assert len(cache) == 1

    def no_tokenizing(*_a, **_k):
        raise AssertionError("the cached scan should have been used")

    builder = SampleBuilder(tok, cfg([f], max_length=12, truncation="right"))
    monkeypatch.setattr(builder, "build", no_tokenizing)
    again = SFTDataset([f], builder, "t", cache=cache)
    assert np.array_equal(again.lengths, first.lengths) and again.stats == first.stats
    monkeypatch.undo()

    # Other settings or rewritten data: a new key, scanned afresh.
    SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=30)), "t", cache=cache)
    assert len(cache) == 2
    write(tmp_path, rows[:5] + rows[:5])
    SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=12, truncation="right")), "t", cache=cache)
    assert len(cache) == 3
    # A damaged entry is ignored, not trusted.
    for k in cache:
        cache[k] = b"garbage"
    fresh = SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=30)), "t", cache=cache)
    assert fresh.stats.rows == 10


def test_order_is_a_seeded_permutation(assets, tok):
    f = str(assets / "data" / "train.parquet")
    ds = SFTDataset([f], SampleBuilder(tok, cfg([f], max_length=64)), "train")
    a, b, c = ds.epoch_order(1, 0, True), ds.epoch_order(1, 0, True), ds.epoch_order(1, 1, True)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert sorted(a.tolist()) == list(range(ds.rows.num_rows))


def test_rank_slices_cover_the_global_batch(assets, tok):
    f = str(assets / "data" / "train.parquet")
    c = cfg([f], max_length=64, train_batch_size=8, micro_batch_size_per_gpu=2)
    ds = SFTDataset([f], SampleBuilder(tok, c), "train")
    one = GlobalBatches(ds, c, 3, 0, 1, 0).step_batches(0, 16)
    two = [GlobalBatches(ds, c, 3, r, 2, 0).step_batches(0, 16) for r in range(2)]
    ids = lambda mbs: [i for mb in mbs for i in mb.sample_ids]  # noqa: E731 - a one-line helper
    assert ids(one) == ids(two[0]) + ids(two[1])


def test_micro_batch_must_divide_per_rank_batch(assets, tok):
    f = str(assets / "data" / "train.parquet")
    c = cfg([f], max_length=64, train_batch_size=4, micro_batch_size_per_gpu=4)
    ds = SFTDataset([f], SampleBuilder(tok, c), "train")
    with pytest.raises(InvalidData,
                       match=r"must divide the per-rank batch \(2 = data.train_batch_size 4 / 2 processes\)"):
        GlobalBatches(ds, c, 0, 0, 2, 0)


def test_packed_loss_equals_padded(assets, tok):
    from transformers import AutoModelForCausalLM

    from sftjob_trainer.loss import ce_sum

    f = str(assets / "data" / "chat_train.parquet")
    ds = SFTDataset([f], SampleBuilder(tok, cfg([f], messages_key="messages", max_length=128)), "train")
    model = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32, attn_implementation="sdpa")
    ids = [0, 1, 2, 3]
    samples = [ds.sample(i) for i in ids]
    padded = collate(samples, ids, packing=False, pad_id=tok.pad_token_id)
    packed = collate(samples, ids, packing=True, pad_id=tok.pad_token_id)
    assert packed.input_ids.shape[0] == 1 and padded.n_targets == packed.n_targets
    with torch.no_grad():
        a = ce_sum(model, padded, torch.device("cpu"), "fp32").item()
        b = ce_sum(model, packed, torch.device("cpu"), "fp32").item()
    assert abs(a - b) / padded.n_targets < 1e-4


def test_scan_reads_only_the_row_groups_of_its_block(tmp_path, tok, monkeypatch):
    """Rank 1 of 2 tokenizes and reads the second half of the rows only; the gathered scan is the 1-rank scan."""
    import sftjob_trainer.data as data

    rows = [{"prompt": f"p{i}", "response": "the kiwi is teal ." * (i % 4)} for i in range(64)]
    f = str(tmp_path / "groups.parquet")
    pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=8)
    c = cfg([f], max_length=12, truncation="right")
    whole = SFTDataset([f], SampleBuilder(tok, c), "t")
    assert whole.stats.truncated > 0 and len(set(whole.lengths.tolist())) > 2

    reads = []
    real_read = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, **kw: reads.append(i) or real_read(self, i, **kw))
    # the other rank's answer, as all_gather would bring it: the first half of the rows
    first_half = (whole.lengths[:32], 0, None)
    monkeypatch.setattr(data.dist_utils, "all_gather_objects",
                        lambda own: [first_half, (own[0], whole.stats.truncated, own[2])])
    second = SFTDataset([f], SampleBuilder(tok, c), "t", rank=1, world=2)
    assert sorted(set(reads)) == [4, 5, 6, 7]
    assert np.array_equal(second.lengths, whole.lengths) and second.stats == whole.stats
