"""The pairing proof (vllm_afd/wire/auth.py, docs/security.md): ranks driven in lockstep over a recording store."""

from __future__ import annotations

import logging

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_afd.wire import auth
from vllm_afd.config.secret import SECRET_ENV, load_secret
from vllm_afd.wire.auth import AUTH_FIX, NO_SECRET, PairingProof, Secret
from vllm_afd.wire.errors import AFDAuthenticationError, AFDProtocolError

KEY = b"correct horse battery staple 0123456789"
OTHER = b"a different secret of the other role"
ONE_TO_ONE = [("ffn", 0), ("attention", 0)]


def key_of(kind, rank):
    return f"afd/{kind}/{rank[0]}/{rank[1]}"


class RecordingStore:
    """The store's set/multi_get over a dict; every value ever written is kept for the scans."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.written: list[tuple[str, bytes]] = []

    def set(self, key, value):
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.data[key] = value
        self.written.append((key, value))

    def multi_get(self, keys):
        return [self.data[key] for key in keys]


def fingerprint_of(rank):
    return f'{{"role":"{rank[0]}","role_rank":{rank[1]}}}'.encode()


def pair(keys, store=None, ranks=ONE_TO_ONE, fingerprints=None, before_verify=None):
    """Every rank's proof in lockstep (nonces, proofs, checks); {rank: None or the exception}."""
    store = RecordingStore() if store is None else store
    fingerprints = fingerprints or {rank: fingerprint_of(rank) for rank in ranks}
    proofs = {rank: PairingProof(None if keys[rank] is None else Secret(keys[rank], "test"), rank, ranks, key_of)
              for rank in ranks}
    for rank, proof in proofs.items():
        store.set(key_of("nonce", rank), proof.nonce)
    results = {}
    for rank, proof in proofs.items():
        try:
            store.set(key_of("proof", rank), proof.prove(store.multi_get([key_of("nonce", r) for r in ranks]),
                                                         fingerprints[rank]))
            store.set(key_of("fingerprint", rank), fingerprints[rank])
        except AFDAuthenticationError as exc:
            results[rank] = exc
    if results:
        return results
    if before_verify is not None:
        before_verify(store)
    for rank, proof in proofs.items():
        try:
            proof.verify(store.multi_get([key_of("proof", r) for r in ranks]),
                         store.multi_get([key_of("fingerprint", r) for r in ranks]))
            results[rank] = None
        except AFDAuthenticationError as exc:
            results[rank] = exc
    return results


def test_ranks_with_the_same_secret_pair_3a2f():
    ranks = [("ffn", 0), ("ffn", 1), ("attention", 0), ("attention", 1), ("attention", 2)]

    results = pair(dict.fromkeys(ranks, KEY), ranks=ranks)

    assert results == dict.fromkeys(ranks)


def test_ranks_without_any_secret_pair_as_before():
    results = pair(dict.fromkeys(ONE_TO_ONE))

    assert results == dict.fromkeys(ONE_TO_ONE)


@pytest.mark.parametrize("wrong", ONE_TO_ONE)
def test_a_wrong_secret_is_refused_on_both_sides_naming_authentication(wrong):
    keys = {rank: OTHER if rank == wrong else KEY for rank in ONE_TO_ONE}

    results = pair(keys)

    for rank, peer in ((ONE_TO_ONE[0], "attention rank 0"), (ONE_TO_ONE[1], "ffn rank 0")):
        message = str(results[rank])
        assert isinstance(results[rank], AFDAuthenticationError)
        assert message.startswith(f"AFD {rank[0]} rank 0: {AUTH_FIX} (the proof of {peer} does not verify")


@pytest.mark.parametrize("without", ONE_TO_ONE)
def test_one_side_without_a_secret_is_refused_naming_the_side_without(without):
    keys = {rank: None if rank == without else KEY for rank in ONE_TO_ONE}
    with_secret = next(rank for rank in ONE_TO_ONE if rank != without)

    results = pair(keys)

    assert all(isinstance(exc, AFDAuthenticationError) and AUTH_FIX in str(exc) for exc in results.values())
    assert f"{without[0]} rank 0 has no secret" in str(results[with_secret])
    assert f"{with_secret[0]} rank 0 requires a shared secret and this rank has none" in str(results[without])


def test_a_proof_recorded_in_an_earlier_rendezvous_is_refused():
    earlier = RecordingStore()
    assert pair(dict.fromkeys(ONE_TO_ONE, KEY), store=earlier) == dict.fromkeys(ONE_TO_ONE)
    recorded = earlier.data[key_of("proof", ("ffn", 0))]

    # A rogue FFN without the secret replays the recorded proof with the same fingerprint bytes.
    results = pair(dict.fromkeys(ONE_TO_ONE, KEY),
                   before_verify=lambda store: store.set(key_of("proof", ("ffn", 0)), recorded))

    assert isinstance(results[("attention", 0)], AFDAuthenticationError)
    assert "the proof of ffn rank 0 does not verify" in str(results[("attention", 0)])


def test_a_proof_moved_to_another_rank_or_over_another_fingerprint_is_refused():
    ranks = [("ffn", 0), ("attention", 0), ("attention", 1)]

    def move(store):
        store.set(key_of("proof", ("attention", 1)), store.data[key_of("proof", ("attention", 0))])

    def refingerprint(store):
        store.set(key_of("fingerprint", ("attention", 0)), fingerprint_of(("attention", 9)))

    moved = pair(dict.fromkeys(ranks, KEY), ranks=ranks, before_verify=move)
    changed = pair(dict.fromkeys(ranks, KEY), ranks=ranks, before_verify=refingerprint)

    assert "the proof of attention rank 1 does not verify" in str(moved[("ffn", 0)])
    assert "the proof of attention rank 0 does not verify" in str(changed[("ffn", 0)])


@pytest.mark.parametrize("keys", [dict.fromkeys(ONE_TO_ONE, KEY), {ONE_TO_ONE[0]: KEY, ONE_TO_ONE[1]: OTHER}])
def test_the_secret_never_appears_in_any_store_value_or_repr(keys):
    store = RecordingStore()

    pair(keys, store=store)

    shown = [KEY, KEY.hex().encode(), KEY[:16], OTHER, OTHER.hex().encode()]
    assert store.written, "nothing was written: not a test"
    for key, value in store.written:
        assert not any(secret in value or secret in key.encode() for secret in shown), (key, value)
    assert "horse" not in repr(Secret(KEY, "test")) and "horse" not in str(Secret(KEY, "test"))


_VALID = st.just(b"0" * 64)
_HOSTILE = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda n: b"f" * n, st.sampled_from([63, 65, 1 << 20])),
    st.text(max_size=80).map(str.encode),
    st.builds(lambda text: text, st.text(max_size=10)),  # not bytes at all
    st.integers(), st.none(),
).filter(lambda value: not (isinstance(value, bytes) and (value == NO_SECRET or
                                                          (len(value) == 64 and all(c in b"0123456789abcdef"
                                                                                    for c in value)))))


@given(_HOSTILE)
@example(b"A" * 64)  # upper-case hex: not what a rank writes
@example(b"f" * (1 << 20))
def test_a_hostile_nonce_is_a_clear_protocol_error(value):
    proof = PairingProof(Secret(KEY, "test"), ("ffn", 0), ONE_TO_ONE, key_of)

    with pytest.raises(AFDProtocolError, match="store key afd/nonce/attention/0 holds") as raised:
        proof.prove([proof.nonce, value], b"{}")

    assert not isinstance(raised.value, AFDAuthenticationError) and len(str(raised.value)) < 600


@given(_HOSTILE)
@example(b"g" * 64)
def test_a_hostile_proof_is_a_clear_protocol_error(value):
    proof = PairingProof(Secret(KEY, "test"), ("ffn", 0), ONE_TO_ONE, key_of)
    proof.prove([proof.nonce, b"0" * 64], b"{}")

    with pytest.raises(AFDProtocolError, match="store key afd/proof/attention/0 holds") as raised:
        proof.verify([b"", value], [b"{}", b"{}"])

    assert not isinstance(raised.value, AFDAuthenticationError) and len(str(raised.value)) < 600


def test_the_secret_comes_from_the_environment_or_the_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(KEY + b"\n")  # `echo` leaves a line end: stripped, so it equals the variable's value

    from_file = load_secret(str(path), environ={})
    from_env = load_secret("", environ={SECRET_ENV: KEY.decode()})

    assert (from_file, from_env) == ((KEY, f"secret_file {path}"), (KEY, SECRET_ENV))
    assert load_secret("", environ={}) is None


def test_both_sources_or_an_empty_variable_are_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(KEY)

    with pytest.raises(ValueError, match="both VLLM_AFD_SECRET and secret_file .* are set; expected one"):
        load_secret(str(path), environ={SECRET_ENV: "x"})
    with pytest.raises(ValueError, match="VLLM_AFD_SECRET is set but empty") as raised:
        load_secret("", environ={SECRET_ENV: " "})
    assert "horse" not in str(raised.value)


def test_the_unauthenticated_warning_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(auth, "_warned", False)

    with caplog.at_level(logging.WARNING, logger="vllm_afd.wire.auth"):
        auth.warn_unauthenticated_once("127.0.0.1:6390")
        auth.warn_unauthenticated_once("127.0.0.1:6390")

    assert len(caplog.records) == 1
    assert "control plane is UNAUTHENTICATED" in caplog.text and "private network" in caplog.text
