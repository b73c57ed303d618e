import gzip
import itertools
import os

import numpy as np
import pytest

from keras_transformer.tokenizers.sentencepiece import TOKENIZER_FILENAME
from keras_transformer.tokenizers.sentencepiece import Tokenizer
from keras_transformer.tokenizers.sentencepiece import train_tokenizer

VOCABULARY_SIZE = 300

ENGLISH_SUBJECTS = ["The teacher", "A naïve student", "My neighbour", "The old café owner", "Our children"]
ENGLISH_VERBS = ["changes the size of", "likes", "crosses", "paints", "sees"]
ENGLISH_OBJECTS = ["the pedestrian crossings", "the street", "a façade", "the piñata", "the big house"]
GERMAN_SUBJECTS = ["Der Lehrer", "Eine naïve Schülerin", "Mein Nachbar", "Der alte Cafébesitzer", "Unsere Kinder"]
GERMAN_VERBS = ["ändert die Größe von", "mag", "überquert", "malt", "sieht"]
GERMAN_OBJECTS = ["die Fußgängerübergänge", "die Straße", "eine Fassade", "das Gemüse", "das große Haus"]


def _corpus(subjects, verbs, objects, end):
    return [f"{s} {v} {o}{end}" for s, v, o in itertools.product(subjects, verbs, objects)]


ENGLISH = _corpus(ENGLISH_SUBJECTS, ENGLISH_VERBS, ENGLISH_OBJECTS, ".")  # 125
GERMAN = _corpus(GERMAN_SUBJECTS, GERMAN_VERBS, GERMAN_OBJECTS, ".") + _corpus(
    GERMAN_SUBJECTS, GERMAN_VERBS, GERMAN_OBJECTS, "?"
)  # 250
EXTRA = ["Größe ändern", "Fußgängerübergänge", "naïve café", "Über Äpfel, Öl und Übel: ÄÖÜ äöü ß é è ê ç ñ ï."]
CORPUS = ENGLISH + GERMAN + EXTRA
ROUND_TRIP = ["Größe ändern", "Fußgängerübergänge", "naïve café", "The teacher likes the street."]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocabulary_size=VOCABULARY_SIZE)


def test_special_ids(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.start_id, tokenizer.end_id) == (0, 1, 2, 3)
    assert tokenizer.vocabulary_size == VOCABULARY_SIZE


def test_encode_appends_end_and_optionally_start(tokenizer):
    [ids] = tokenizer.encode(["Größe ändern"])
    assert ids[-1] == tokenizer.end_id and tokenizer.start_id not in ids
    assert all(4 <= i < VOCABULARY_SIZE for i in ids[:-1])
    [with_start] = tokenizer.encode(["Größe ändern"], add_start=True, add_end=False)
    assert with_start == [tokenizer.start_id] + ids[:-1]
    assert tokenizer.encode("Größe ändern") == [ids]


def test_no_unknown_ids_for_training_characters(tokenizer):
    for ids in tokenizer.encode(CORPUS):
        assert tokenizer.unk_id not in ids


def test_round_trip_non_ascii(tokenizer):
    ids = tokenizer.encode(ROUND_TRIP)
    assert tokenizer.decode(ids) == ROUND_TRIP


def test_decode_stops_at_end_and_drops_padding(tokenizer):
    ids = tokenizer.encode(ROUND_TRIP, add_start=True)
    length = max(len(row) for row in ids) + 3
    # Generated rows: start, tokens, end, then 0-padding, plus junk after the end.
    padded = np.zeros((len(ids), length), "int32")
    for row, seq in zip(padded, ids):
        row[: len(seq)] = seq
        row[len(seq)] = 7  # After the end id: must be ignored.
    assert tokenizer.decode(padded) == ROUND_TRIP
    assert tokenizer.decode(ids[0]) == ROUND_TRIP[:1]


def test_save_load_round_trip(tokenizer, tmp_path):
    path = tokenizer.save(tmp_path / "preset")
    assert path == os.path.join(tmp_path / "preset", TOKENIZER_FILENAME)
    assert sorted(os.listdir(tmp_path / "preset")) == [TOKENIZER_FILENAME]  # No temp file left.
    loaded = Tokenizer.load(tmp_path / "preset")
    assert loaded.proto == tokenizer.proto
    assert loaded.encode(CORPUS) == tokenizer.encode(CORPUS)
    # Saving again replaces the file.
    tokenizer.save(tmp_path / "preset")
    assert Tokenizer.load(tmp_path / "preset").proto == tokenizer.proto


def test_load_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{TOKENIZER_FILENAME}"):
        Tokenizer.load(tmp_path)


def test_keras_hub_tokenizer_gives_the_same_ids(tokenizer):
    keras_hub_tokenizer = tokenizer.to_keras_hub()
    for text in ROUND_TRIP:
        ids = keras_hub_tokenizer.tokenize(text)
        ids = np.asarray(ids).tolist()
        assert ids == tokenizer.encode([text], add_end=False)[0]
    assert keras_hub_tokenizer.vocabulary_size() == tokenizer.vocabulary_size
    assert keras_hub_tokenizer.token_to_id("</s>") == tokenizer.end_id


def test_tf_text_tokenizer_gives_the_same_ids(tokenizer):
    import tensorflow as tf

    tf_text_tokenizer = tokenizer.tf_text_tokenizer()
    ids = tf_text_tokenizer.tokenize(tf.constant(ROUND_TRIP))
    assert ids.dtype == tf.int32
    assert ids.to_list() == tokenizer.encode(ROUND_TRIP)
    with_start = tokenizer.tf_text_tokenizer(add_start=True, add_end=False)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def tokenize(texts):
        return with_start.tokenize(texts).to_tensor()

    dense = tokenize(tf.constant(ROUND_TRIP)).numpy()
    expected = tokenizer.encode(ROUND_TRIP, add_start=True, add_end=False)
    assert [row[: len(seq)].tolist() for row, seq in zip(dense, expected)] == expected
    assert tokenizer.decode(dense) == ROUND_TRIP


def test_training_is_deterministic(tokenizer):
    assert train_tokenizer(CORPUS, vocabulary_size=VOCABULARY_SIZE).proto == tokenizer.proto


def test_train_from_files(tmp_path, tokenizer):
    english, german = tmp_path / "train.en", tmp_path / "train.de.gz"
    english.write_text("\n".join(ENGLISH + EXTRA) + "\n", encoding="utf-8")
    with gzip.open(german, "wt", encoding="utf-8") as f:
        f.write("\n\n".join(GERMAN) + "\n")  # Blank lines are skipped.
    from_files = train_tokenizer([english, str(german)], vocabulary_size=VOCABULARY_SIZE)
    assert from_files.decode(from_files.encode(ROUND_TRIP)) == ROUND_TRIP
    assert train_tokenizer([english, str(german)], vocabulary_size=VOCABULARY_SIZE).proto == from_files.proto


def test_sampled_training_is_deterministic():
    first = train_tokenizer(CORPUS, vocabulary_size=200, max_sentences=200)
    second = train_tokenizer(CORPUS, vocabulary_size=200, max_sentences=200)
    assert first.proto == second.proto


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"vocabulary_size": 3}, ValueError, "vocabulary_size=3"),
        ({"model_type": "wordpiece"}, ValueError, "model_type='wordpiece'"),
        ({"max_sentences": 0}, ValueError, "max_sentences=0"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        train_tokenizer(CORPUS, **kwargs)


def test_missing_corpus_file_is_named(tmp_path):
    missing = tmp_path / "missing.en"
    with pytest.raises(FileNotFoundError, match="missing.en"):
        train_tokenizer(missing)


def test_rejects_a_proto_without_padding_at_zero():
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    # SentencePiece's defaults: no padding piece (pad_id=-1), unk=0, bos=1, eos=2.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=100, minloglevel=2
    )
    with pytest.raises(ValueError, match="pad_id=-1"):
        Tokenizer(model.getvalue())
    with pytest.raises(TypeError, match="received str"):
        Tokenizer("not bytes")


# ---------------------------------------------------------------------- #
# Both tokenizers answer for themselves (no caller checks the type)
# ---------------------------------------------------------------------- #
def _marian_tokenizer(language_codes=()):
    from keras_transformer.convert.standin import _marian_vocab, _train_spm
    from keras_transformer.tokenizers.marian import MarianTokenizer

    source, target = _train_spm(ENGLISH + EXTRA, 70), _train_spm(GERMAN + EXTRA, 80)
    return MarianTokenizer(source, target, _marian_vocab(source, target, language_codes))


@pytest.fixture(scope="module")
def marian():
    return _marian_tokenizer()


@pytest.mark.parametrize("kind", ["tokenizer", "marian"])
def test_both_tokenizers_name_their_files_and_reload_from_them(kind, request, tmp_path):
    from keras_transformer.tokenizers.sentencepiece import load_tokenizer

    tokenizer = request.getfixturevalue(kind)
    files = tokenizer.files()
    assert files == type(tokenizer).FILES and all(isinstance(name, str) for name in files)
    tokenizer.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(files)
    # load_tokenizer recognises each by the last of its files.
    os.remove(tmp_path / files[-1])
    assert load_tokenizer(tmp_path) is None
    tokenizer.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert type(loaded) is type(tokenizer) and loaded.format == tokenizer.format
    assert loaded.files() == files and loaded.pieces() == tokenizer.pieces()
    assert loaded.encode(ROUND_TRIP) == tokenizer.encode(ROUND_TRIP)
    assert loaded.decode(tokenizer.encode(ROUND_TRIP, target=True)) == tokenizer.decode(
        tokenizer.encode(ROUND_TRIP, target=True))


@pytest.mark.parametrize("kind", ["tokenizer", "marian"])
def test_both_tokenizers_answer_the_same_questions(kind, request):
    from keras_transformer.token_ids import END_ID, PAD_ID, START_ID, UNK_ID

    tokenizer = request.getfixturevalue(kind)
    assert tokenizer.format == {"tokenizer": "sentencepiece", "marian": "marian"}[kind]
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.start_id, tokenizer.end_id) == (
        PAD_ID, UNK_ID, START_ID, END_ID)
    assert tokenizer.language_codes == []
    assert isinstance(tokenizer.source_proto, bytes) and isinstance(tokenizer.target_proto, bytes)
    if kind == "tokenizer":
        assert tokenizer.sentencepiece_ids and tokenizer.source_input == ""
        assert tokenizer.source_proto == tokenizer.target_proto == tokenizer.proto
    else:
        assert not tokenizer.sentencepiece_ids and ">>xx<<" in tokenizer.source_input
        assert len(tokenizer.marian_ids) == tokenizer.vocabulary_size
        assert tokenizer.source_proto != tokenizer.target_proto
    # source_pieces are the pieces encode numbers (a piece outside the vocabulary is unk), without the end.
    ids_of = {piece: i for i, piece in enumerate(tokenizer.pieces())}
    for text in ROUND_TRIP + ["", "東京 Größe"]:
        pieces = tokenizer.source_pieces(text)
        assert all(isinstance(piece, str) for piece in pieces)
        assert [ids_of.get(piece, tokenizer.unk_id) for piece in pieces] == tokenizer.encode(text, add_end=False)[0]


def test_marian_source_pieces_keep_a_language_code_whole():
    tokenizer = _marian_tokenizer(language_codes=(">>deu<<", ">>nld<<"))
    assert tokenizer.language_codes == [">>deu<<", ">>nld<<"]
    pieces = tokenizer.source_pieces(">>nld<< The teacher likes the street.")
    assert pieces[0] == ">>nld<<" and "".join(pieces[1:]).replace("\u2581", " ").strip() == (
        "The teacher likes the street.")
    assert [tokenizer.id_of(piece) for piece in pieces] == tokenizer.encode(
        ">>nld<< The teacher likes the street.", add_end=False)[0]


@pytest.mark.parametrize("first, second", [
    ("keras_transformer.tokenizers.marian", "keras_transformer.tokenizers.sentencepiece"),
    ("keras_transformer.tokenizers.sentencepiece", "keras_transformer.tokenizers.marian"),
])
def test_either_tokenizer_module_imports_first_without_a_cycle(first, second):
    """tokenizers.marian needs nothing of tokenizers.sentencepiece (the special ids live in token_ids); tokenizers.sentencepiece imports it."""
    import subprocess
    import sys

    code = (
        f"import sys, {first}, {second}\n"
        "from keras_transformer.tokenizers.sentencepiece import PAD_ID, MarianTokenizer, Tokenizer, load_tokenizer\n"
        "from keras_transformer.tokenizers import marian\n"
        "assert MarianTokenizer is marian.MarianTokenizer and PAD_ID == 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    alone = (
        "import sys, keras_transformer.tokenizers.marian\n"
        "assert 'keras_transformer.tokenizers.sentencepiece' not in sys.modules, 'tokenizers.marian imports tokenizers.sentencepiece'\n"
    )
    subprocess.run([sys.executable, "-c", alone], check=True, timeout=120)


@pytest.mark.parametrize("old, new", [
    ("keras_transformer.tokenizer", "keras_transformer.tokenizers.sentencepiece"),
    ("keras_transformer.tokenizer_base", "keras_transformer.tokenizers.base"),
    ("keras_transformer.marian_tokenizer", "keras_transformer.tokenizers.marian"),
    ("keras_transformer.nllb_tokenizer", "keras_transformer.tokenizers.nllb"),
    ("keras_transformer.fsmt_tokenizer", "keras_transformer.tokenizers.fsmt"),
])
def test_the_old_tokenizer_paths_re_export_the_new_modules(old, new):
    import importlib

    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    public = [name for name in vars(new_module) if not name.startswith("_")]
    assert public and all(getattr(old_module, name) is getattr(new_module, name) for name in public)
