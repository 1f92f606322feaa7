"""verify's precision check, in the probe: every floating-point tensor of the run in float64.

Setting torch's default dtype to float64 reaches the model and the tensors made without a
dtype, but not those a script makes as float32 itself: `torch.FloatTensor(...)` and
`torch.cuda.FloatTensor(...)` (and the aliases scripts bind to them), `.float()`,
`.to(torch.float32)`, `.type(torch.FloatTensor)`, `dtype=torch.float32` in a factory, numpy
float32 arrays turned into tensors. Those would meet the float64 model ("mat1 and mat2 must
have the same dtype") or keep float32 rounding in one place. Here they are made float64 in
both runs alike:
- the legacy float32 tensor types are the float64 ones (`torch.FloatTensor` is
  `torch.DoubleTensor`), so the script's own aliases, bound after the probe installs, follow;
- a torch function mode asks for float64 wherever a call asks for float32 (a dtype argument,
  a type name, `.float()`), so nothing is rounded to float32 on the way;
- a float32 tensor born in a call none of whose tensor arguments is float32 (numpy float32
  data: `torch.tensor`, `as_tensor`, `from_numpy`) is widened as it is made. Tensors that are
  already float32 (none, unless made outside torch) are left as they are, so views and
  in-place writes keep their meaning.

Like probe.py, this file needs only the standard library and torch.
"""

from __future__ import annotations

FLOAT32_TYPE_NAMES = {
    "torch.FloatTensor": "torch.DoubleTensor",
    "torch.cuda.FloatTensor": "torch.cuda.DoubleTensor",
}


def widen_script_floats(probe) -> None:
    """Make float32 the script asks for float64, for the rest of the run (see above)."""
    torch = probe.torch
    torch.FloatTensor = torch.DoubleTensor
    torch.cuda.FloatTensor = torch.cuda.DoubleTensor
    widen_from_numpy(probe)
    widening_mode(torch)(probe).__enter__()  # never left: the run ends with the process


def widen_from_numpy(probe) -> None:
    """`torch.from_numpy` of a float32 array gives float64 (torch's function modes do not
    see it). The tensor no longer shares the array's memory: the precision check compares
    gradients, and a script that writes through such a tensor into its array is rare."""
    torch = probe.torch
    from_numpy = torch.from_numpy

    def widened_from_numpy(array):
        tensor = from_numpy(array)
        if tensor.dtype != torch.float32:
            return tensor
        probe.count("float64_widened")
        return tensor.double()

    torch.from_numpy = widened_from_numpy


def widening_mode(torch):
    """The torch function mode class that asks for float64 in place of float32."""
    from torch.overrides import TorchFunctionMode

    class WidenedFloats(TorchFunctionMode):
        def __init__(self, probe) -> None:
            super().__init__()
            self.probe = probe

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.float:
                func = torch.Tensor.double
            else:
                args = tuple(float64_asked(torch, a) for a in args)
                kwargs = {key: float64_asked(torch, value) for key, value in kwargs.items()}
            result = func(*args, **kwargs)
            if born_float32(torch, result, args, kwargs):
                self.probe.count("float64_widened")
                return result.double()
            return result

    return WidenedFloats


def float64_asked(torch, value):
    """`value` with a request for float32 made a request for float64."""
    if value is torch.float32:
        return torch.float64
    if isinstance(value, str):
        return FLOAT32_TYPE_NAMES.get(value, value)
    return value


def born_float32(torch, result, args, kwargs) -> bool:
    """Whether `result` is a float32 tensor none of the call's tensor arguments was."""
    if not isinstance(result, torch.Tensor) or result.dtype != torch.float32:
        return False
    return not any(is_float32(torch, value) for value in (*args, *kwargs.values()))


def is_float32(torch, value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float32
    if isinstance(value, (list, tuple)):
        return any(is_float32(torch, item) for item in value)
    return False
