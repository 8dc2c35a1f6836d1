"""The chunked target log-probs equal ``log_softmax(...).gather(...)`` in value and gradient."""

from __future__ import annotations

import pytest
import torch

from learner.algorithms import chunked_log_probs, entropy_from_logits, target_log_probs


def plain(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("chunk_elements", [1 << 27, 3 * 50, 1])  # one chunk, three rows, one row
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_and_gradients_equal_the_plain_form(
    dtype: torch.dtype, chunk_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunked_log_probs, "CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(11, 50, generator=generator) * 4).to(dtype)
    logits[3, 7] = float("-inf")  # a token filtered out
    targets = torch.randint(0, 50, (11,), generator=generator)
    targets[3] = 8  # not the filtered token
    upstream = torch.randn(11, generator=generator)

    ours = logits.clone().requires_grad_()
    log_probs, entropy = target_log_probs(ours, targets, with_entropy=True)
    (log_probs * upstream).sum().backward()
    reference = logits.clone().requires_grad_()
    expected = plain(reference, targets)
    (expected * upstream).sum().backward()

    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
    assert log_probs.dtype == torch.float32 and not entropy.requires_grad
    torch.testing.assert_close(log_probs, expected.float(), atol=1e-6, rtol=1e-6)  # same float32 math per row
    torch.testing.assert_close(entropy, entropy_from_logits(logits).float(), atol=1e-5, rtol=1e-5)
    assert ours.grad is not None and reference.grad is not None and ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad, reference.grad, **tolerance)
    assert torch.isfinite(ours.grad).all() and ours.grad[3, 7] == 0


def test_entropy_is_left_out_unless_asked_and_shapes_are_checked() -> None:
    logits = torch.randn(4, 9)
    assert torch.equal(target_log_probs(logits, torch.zeros(4, dtype=torch.long))[1], torch.zeros(4))
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        target_log_probs(logits[None], torch.zeros(4, dtype=torch.long))


def test_the_compiled_kernels_cuda_runs_equal_the_eager_ones() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(37, 500, generator=generator) * 4).bfloat16()
    weight = torch.randn(37, generator=generator)
    log_z = chunked_log_probs._log_z(logits)
    for function, args in (
        (chunked_log_probs._log_z, (logits,)),
        (chunked_log_probs._entropy, (logits, log_z)),
        (chunked_log_probs._minus_p_times_g, (logits, log_z, weight)),
    ):
        compiled, eager = chunked_log_probs._compiled(function)(*args), function(*args)
        assert compiled.dtype == eager.dtype
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5, msg=function.__name__)
