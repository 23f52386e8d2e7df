"""Every tensor factory in ``saguaro/runtime`` and ``saguaro/tensor_math`` names its device.

A factory without ``device=`` makes a CPU tensor (or one on whatever ``torch.set_default_device`` says),
which then meets CUDA tensors in a round and raises, or copies through pageable memory. So each call of
a ``torch`` factory there names ``device=...`` (``device="cpu"`` where host bookkeeping is meant), or
is a ``*_like`` (same device as its argument), and a ``torch.Generator`` names its device too. Checked
on the source (AST), so it holds on a machine without CUDA.
"""

from __future__ import annotations

import ast
from pathlib import Path

import saguaro

# torch functions that make a tensor from sizes or Python data: the device is theirs to name
FACTORIES = frozenset(
    {
        "arange",
        "as_tensor",
        "asarray",
        "empty",
        "empty_strided",
        "eye",
        "full",
        "linspace",
        "logspace",
        "ones",
        "rand",
        "randint",
        "randn",
        "randperm",
        "range",
        "scalar_tensor",
        "tensor",
        "tril_indices",
        "triu_indices",
        "zeros",
        "Generator",
    }
)
PACKAGE = Path(saguaro.__file__).parent
CHECKED = [PACKAGE / "runtime", PACKAGE / "tensor_math"]


def unnamed_devices(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: call`` of every ``torch`` factory call in ``source`` that names no device."""
    tree = ast.parse(source, filename)
    torch_names, factory_names = {"torch"}, {}  # `import torch as th`; `from torch import zeros as z`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname or a.name for a in node.names if a.name == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            factory_names |= {a.asname or a.name: a.name for a in node.names if a.name in FACTORIES}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, name = node.func, None
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in torch_names
        ):
            name = func.attr if func.attr in FACTORIES else None
        elif isinstance(func, ast.Name):
            name = factory_names.get(func.id)
        if name is None:
            continue
        # a Generator's device may be its one positional argument; `**kwargs` does not say which device
        named = any(k.arg == "device" for k in node.keywords) or (name == "Generator" and len(node.args) == 1)
        if not named:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_tensor_factory_in_runtime_and_tensor_math_names_its_device():
    files = sorted(p for folder in CHECKED for p in folder.rglob("*.py"))
    assert len(files) > 20, f"the checked folders look empty: {CHECKED}"
    offenders = [
        hit
        for path in files
        for hit in unnamed_devices(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not offenders, (
        "tensor factories without device= (name the device of the tensors they meet, or "
        'device="cpu" for host bookkeeping):\n' + "\n".join(offenders)
    )


def test_the_check_finds_what_it_is_meant_to_find():
    planted = (
        "import torch\nimport torch as th\nfrom torch import zeros as z, arange\n"
        "a = torch.zeros(n)\n"  # 4: flagged
        "b = torch.zeros(n, device=x.device)\n"
        "c = th.tensor([1, 2], dtype=torch.long)\n"  # 6: flagged
        "d = z(3)\n"  # 7: flagged
        "e = arange(3, device='cpu')\n"
        "f = torch.zeros_like(x)\n"
        "g = torch.Generator()\n"  # 10: flagged
        "h = torch.Generator(device=dev)\n"
        "i = torch.Generator('cuda')\n"
        "j = torch.full((), 1.0, **options)\n"  # 13: flagged (which device?)
        "k = x.new_zeros(3)\n"
    )
    lines = sorted(int(hit.split(":")[1]) for hit in unnamed_devices(planted))
    assert lines == [4, 6, 7, 10, 13]
