"""``csrun.core.DataParallel`` in the projects users bring (issue 38): copied and saved as
an ``nn.Module`` (EMA and SWA through ``AveragedModel``), Hugging Face's
``num_items_in_batch``, cache objects among the outputs, batch-dependent losses.

Each project is a small stand-in trained side by side with its plain reference: the same
loop on the unwrapped model (``torch.nn.DataParallel`` on a CPU-only machine calls the
module itself, so it is that reference too). Where ``transformers`` is installed, a tiny
GPT-2 checks the same on the real classes.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

import csrun.core as cs

TOL = 1e-5
DEVICES = ["CPU:0", "CPU:1"]


def _bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batches(count=6, size=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(count)]


def _assert_close_states(got: dict, want: dict):
    assert list(got) == list(want)
    for key in want:
        if want[key].is_floating_point():
            torch.testing.assert_close(got[key], want[key], rtol=TOL, atol=TOL, msg=key)
        else:
            assert torch.equal(got[key], want[key]), key


def _train(model, batches, optimizer=None):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return optimizer


# -- copies: deepcopy, pickle, torch.save -------------------------------------------------
def _copies(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return {"deepcopy": copy.deepcopy(model),
            "pickle": pickle.loads(pickle.dumps(model)),
            "torch.save": torch.load(buffer, weights_only=False)}


def test_a_trained_wrapper_copies_pickles_and_saves_as_torchs_does():
    batches = _batches()
    model = cs.DataParallel(_bn_mlp(), device_ids=DEVICES)
    optimizer = _train(model, batches[:3])
    at_copy = copy.deepcopy(model.state_dict())
    copies = _copies(model)
    _train(model, batches[3:], optimizer)  # the original trains on, its copies do not move
    for how, twin in copies.items():
        assert type(twin) is cs.DataParallel and twin.device_ids == model.device_ids, how
        assert twin.strategy is not model.strategy, how  # a strategy of its own
        assert not any(p is q for p, q in zip(twin.parameters(), model.parameters())), how
        _assert_close_states(twin.state_dict(), at_copy)


def test_a_copy_trains_exactly_as_the_original_from_the_same_point():
    batches = _batches()
    model = cs.DataParallel(_bn_mlp(), device_ids=DEVICES)
    _train(model, batches[:2], torch.optim.SGD(model.parameters(), lr=0.1))
    for how, twin in _copies(model).items():
        original = copy.deepcopy(model.module)  # the plain module, at the same point
        _train(twin, batches[2:], torch.optim.SGD(twin.parameters(), lr=0.1))
        _train(original, batches[2:], torch.optim.SGD(original.parameters(), lr=0.1))
        _assert_close_states(twin.module.state_dict(), original.state_dict())
        assert twin.strategy.num_replicas_in_sync == 2, how


def test_a_copy_made_before_any_forward_and_the_original_both_train():
    model = cs.DataParallel(_bn_mlp(), device_ids=DEVICES)
    twin = copy.deepcopy(model)
    _train(model, _batches(2))
    _train(twin, _batches(2))
    _assert_close_states(twin.state_dict(), model.state_dict())


# -- EMA and SWA: torch.optim.swa_utils.AveragedModel ------------------------------------
def _ema_project(wrap):
    """An EMA project: the averaged model follows training, buffers included."""
    model = wrap(_bn_mlp())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        ema.update_parameters(model)
    ema.eval()
    return ema.state_dict(), ema(torch.linspace(-1, 1, 24).view(6, 4))


def _swa_project(wrap):
    """An SWA project: averaging from the third step, SWALR, then update_bn."""
    model = wrap(_bn_mlp())
    swa = AveragedModel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = SWALR(optimizer, swa_lr=0.05, anneal_epochs=2)
    batches = _batches()
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step >= 2:
            swa.update_parameters(model)
            scheduler.step()
    update_bn([x for x, _ in batches], swa)
    swa.eval()
    return swa.state_dict(), swa(torch.linspace(-1, 1, 24).view(6, 4))


@pytest.mark.parametrize("project", [_ema_project, _swa_project], ids=["ema", "swa"])
def test_averaged_model_trains_as_with_torchs_data_parallel(project):
    want_state, want_out = project(nn.DataParallel)  # on a CPU: the module itself
    got_state, got_out = project(lambda m: cs.DataParallel(m, device_ids=DEVICES))
    _assert_close_states(got_state, want_state)
    torch.testing.assert_close(got_out, want_out, rtol=TOL, atol=TOL)


# -- Hugging Face's num_items_in_batch ----------------------------------------------------
class TokenModel(nn.Module):
    """A causal-LM stand-in: a loss summed over the tokens whose label is not -100,
    divided by ``num_items_in_batch`` when given (the whole batch's count, as
    transformers' ``ForCausalLMLoss``), else their mean over this call's tokens."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.out(torch.tanh(self.embed(input_ids)))
        if labels is None:
            return {"logits": logits}
        flat = logits.flatten(0, 1), labels.flatten()
        if num_items_in_batch is None:
            loss = F.cross_entropy(*flat, ignore_index=-100)
        else:
            loss = F.cross_entropy(*flat, ignore_index=-100, reduction="sum") / \
                num_items_in_batch
        return {"loss": loss, "logits": logits}


def _token_batches(count=4, size=6, length=5):
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, 11, (size, length), generator=g)
        labels = ids.roll(-1, 1)
        labels[: size // 2, 2:] = -100  # padding in the first half only: unequal counts
        batches.append((ids, labels))
    return batches


def _hf_loop(model, count_as, accumulate=2):
    """Gradient accumulation over ``accumulate`` batches with the whole step's token
    count, as transformers' Trainer does."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, batches = [], _token_batches()
    for start in range(0, len(batches), accumulate):
        group = batches[start:start + accumulate]
        count = sum(int((labels != -100).sum()) for _, labels in group)
        optimizer.zero_grad()
        for ids, labels in group:
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=count_as(count))
            loss = loss["loss"]
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    return losses


@pytest.mark.parametrize("count_as", [int, torch.tensor], ids=["int", "tensor"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_num_items_in_batch_gives_the_plain_loss_and_gradients(replicas, count_as):
    plain = TokenModel()
    want = _hf_loop(plain, count_as)
    wrapped = cs.DataParallel(TokenModel(), device_ids=[f"CPU:{i}" for i in range(replicas)])
    got = _hf_loop(wrapped, count_as)
    assert got == pytest.approx(want, rel=TOL, abs=TOL)
    _assert_close_states(wrapped.module.state_dict(), plain.state_dict())


def test_a_per_token_mean_with_padding_is_the_replicas_weighted_mean_as_documented():
    # without num_items_in_batch each replica averages over its own tokens: the combined
    # loss weighs replicas by examples, not tokens (docs/own-training.md says so)
    ids, labels = _token_batches()[0]
    plain = TokenModel()(input_ids=ids, labels=labels)["loss"]
    wrapped = cs.DataParallel(TokenModel(), device_ids=DEVICES)
    got = wrapped(input_ids=ids, labels=labels)["loss"]
    halves = [TokenModel()(input_ids=i, labels=l)["loss"]
              for i, l in zip(ids.split(3), labels.split(3))]
    torch.testing.assert_close(got, sum(halves) / 2)
    assert abs(got.item() - plain.item()) > 1e-3


def test_a_token_sum_over_a_global_count_on_the_gathered_logits_is_exact():
    ids, labels = _token_batches()[0]
    count = int((labels != -100).sum())

    def loss_of(model):
        logits = model(input_ids=ids)["logits"]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction="sum") / count
    plain, wrapped = TokenModel(), cs.DataParallel(TokenModel(), device_ids=DEVICES)
    want, got = loss_of(plain), loss_of(wrapped)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want)
    for p, q in zip(wrapped.module.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=TOL)


# -- a class-weighted loss on the gathered output -------------------------------------
def test_a_class_weighted_mean_on_the_gathered_output_trains_as_the_plain_loop():
    weights = torch.tensor([1.0, 4.0, 0.5])

    def train(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches():
            optimizer.zero_grad()
            F.cross_entropy(model(x), y, weight=weights).backward()
            optimizer.step()
        return model
    plain = train(_bn_mlp())
    wrapped = train(cs.DataParallel(_bn_mlp(), device_ids=DEVICES))
    _assert_close_states(wrapped.module.state_dict(), plain.state_dict())


# -- cache objects among the outputs ---------------------------------------------------
class Layer:
    """The shape of transformers' ``DynamicLayer``: keys and values [B, heads, T, d]."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.is_initialized, self.device = True, keys.device


class Cache:
    """The shape of transformers' ``DynamicCache``: a list of layers, plain settings."""

    def __init__(self, layers):
        self.layers, self.offloading = layers, False

    def get_seq_length(self):
        return self.layers[0].keys.shape[-2]


class Decoder(nn.Module):
    """A cached decoder's output: logits and the cache of its keys and values."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.key, self.value, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):  # x: [B, T, 4]
        keys, values = self.key(x).unsqueeze(1), self.value(x).unsqueeze(1)
        return {"logits": self.out(x), "past_key_values": Cache([Layer(keys, values)])}


def test_a_cache_in_the_output_is_gathered_as_its_type_and_trains():
    x = torch.randn(5, 3, 4)
    plain, wrapped = Decoder(), cs.DataParallel(Decoder(), device_ids=DEVICES)
    want, got = plain(x), wrapped(x)
    cache = got["past_key_values"]
    assert type(cache) is Cache and type(cache.layers[0]) is Layer
    assert cache.get_seq_length() == 3 and cache.offloading is False
    assert cache.layers[0].device == torch.device("cpu") and cache.layers[0].is_initialized
    torch.testing.assert_close(cache.layers[0].keys, want["past_key_values"].layers[0].keys)
    (want["past_key_values"].layers[0].values.sum() + want["logits"].sum()).backward()
    (cache.layers[0].values.sum() + got["logits"].sum()).backward()
    for p, q in zip(wrapped.module.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class Registered:
    """A class torch's pytree knows: gathered through its flatten and unflatten."""

    def __init__(self, tensor, tag):
        self.tensor, self.tag = tensor, tag


pytree.register_pytree_node(Registered, lambda r: ([r.tensor], r.tag),
                            lambda children, tag: Registered(children[0], tag))


class ReturnsRegistered(nn.Module):
    def forward(self, x):
        return Registered(x * 2, "twice")


def test_a_pytree_class_in_the_output_is_gathered_as_its_type():
    got = cs.DataParallel(ReturnsRegistered(), device_ids=DEVICES)(torch.arange(5.0))
    assert type(got) is Registered and got.tag == "twice"
    assert got.tensor.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


class DifferingObject(nn.Module):
    class Note:
        def __init__(self, rows):
            self.rows = rows

    def forward(self, x):
        return x, self.Note(len(x))


def test_an_object_whose_plain_attributes_differ_is_refused_naming_it():
    model = cs.DataParallel(DifferingObject(), device_ids=DEVICES)
    with pytest.raises(TypeError, match=r"Note\.rows differs between replicas \(3, 2\)"):
        model(torch.ones(5, 2))


# -- the real thing, where transformers is installed --------------------------------------
def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=40,
                                     n_positions=16, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers, transformers.GPT2LMHeadModel(config)


def test_gpt2_num_items_in_batch_and_its_cache_under_data_parallel():
    transformers, plain = _gpt2()
    wrapped = cs.DataParallel(copy.deepcopy(plain), device_ids=DEVICES)
    ids = torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 3:] = -100
    count = int((labels[:, 1:] != -100).sum())
    want = plain(input_ids=ids, labels=labels, num_items_in_batch=count, use_cache=True)
    got = wrapped(input_ids=ids, labels=labels, num_items_in_batch=count, use_cache=True)
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=TOL)
    want.loss.backward()
    got.loss.backward()
    for p, q in zip(wrapped.module.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=1e-6)
    cache = got.past_key_values
    assert isinstance(cache, transformers.DynamicCache)
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(cache.layers[0].keys, want.past_key_values.layers[0].keys)
