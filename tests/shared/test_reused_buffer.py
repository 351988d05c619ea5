"""ReusedBuffer: one storage handed out again without autograd, never to a graph."""
import pytest
import torch

from recforge.utils.reused_buffer import ReusedBuffer


def test_without_autograd_the_storage_is_reused_and_grows_to_the_largest_request():
    buffer = ReusedBuffer()
    with torch.no_grad():
        first = buffer.take((4, 5), torch.float32, torch.device("cpu"))
        smaller = buffer.take((3, 2), torch.float32, torch.device("cpu"))
        assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (3, 2) and smaller.is_contiguous()
        larger = buffer.take((7, 5), torch.float32, torch.device("cpu"))
        assert buffer.held == 35
        assert buffer.take((2, 5), torch.float32, torch.device("cpu")).data_ptr() == larger.data_ptr()
        # another dtype: storage of that dtype
        ints = buffer.take((2, 5), torch.int32, torch.device("cpu"))
        assert ints.dtype == torch.int32 and buffer.held == 10
    buffer.release()
    assert buffer.held == 0


def test_under_autograd_every_call_gets_a_fresh_tensor_and_the_storage_is_left_alone():
    buffer = ReusedBuffer()
    with torch.no_grad():
        kept = buffer.take((4,), torch.float32, torch.device("cpu"))
    a = buffer.take((4,), torch.float32, torch.device("cpu"))
    b = buffer.take((4,), torch.float32, torch.device("cpu"))
    assert len({a.data_ptr(), b.data_ptr(), kept.data_ptr()}) == 3
    assert buffer.held == 4


def test_storage_made_in_inference_mode_is_replaced_outside_it():
    buffer = ReusedBuffer()
    with torch.inference_mode():
        inside = buffer.take((3,), torch.float32, torch.device("cpu"))
        inside.fill_(1.0)
    with torch.no_grad():
        outside = buffer.take((3,), torch.float32, torch.device("cpu"))
        outside.fill_(2.0)  # an inference tensor here would refuse the write
    assert not outside.is_inference()
    with torch.inference_mode():
        assert buffer.take((3,), torch.float32, torch.device("cpu")).is_inference()


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)])
def test_empty_requests(shape):
    with torch.no_grad():
        assert ReusedBuffer().take(shape, torch.float32, torch.device("cpu")).shape == shape
