"""The CPU twin of ``npu_apply_adam_w`` (``zeroplus/kernels/npu_adam_w.py``) against its reference twin,
``torch.optim.AdamW``: five steps with weight decay, and with ``maximize``, the values within relative 1e-6 (the bias
corrections are folded in another order) and the states within 1e-7 (torch lerps); what the twin does not
state is refused."""
from __future__ import annotations

import pytest
import torch

from zeroplus.kernels.npu_adam_w import allocate, apply_adam_w

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


@pytest.mark.parametrize("maximize", [False, True])
def test_the_kernel_steps_like_torch_adamw(maximize):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=g)
    grads = [torch.randn(1000, generator=g) for _ in range(5)]
    lr, wd, betas, eps = 1e-2, 0.1, (0.9, 0.999), 1e-8
    reference = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([reference], lr=lr, betas=betas, eps=eps, weight_decay=wd, maximize=maximize)
    var = start.clone()
    m, v = (allocate([1000], dtype=torch.float32, device=torch.device("cpu")).zero_() for _ in range(2))
    for step, grad in enumerate(grads):
        reference.grad = grad.clone()
        opt.step()
        apply_adam_w(betas[0] ** step, betas[1] ** step, lr, wd, betas[0], betas[1], eps, grad, None, False,
                     maximize, out=(var, m, v))
        torch.testing.assert_close(var, reference.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, opt.state[reference]["exp_avg"], rtol=1e-6, atol=1e-7)  # torch lerps
    torch.testing.assert_close(v, opt.state[reference]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_what_the_twin_does_not_state_is_refused():
    t = torch.zeros(4)
    with pytest.raises(NotImplementedError, match="max_grad_norm and amsgrad"):
        apply_adam_w(1.0, 1.0, 1e-3, 0.0, 0.9, 0.999, 1e-8, t, None, True, False, out=(t, t.clone(), t.clone()))
