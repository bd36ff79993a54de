"""The call syntaxes of the families served, each in its own module; FORMATS is the order in which
a chat template's syntax is looked for (smoe.serve.tools.template): a template's own call is read
back by exactly one of them."""

from smoe.serve.tools.formats.base import CallFormat
from smoe.serve.tools.formats.deepseek import DEEPSEEK
from smoe.serve.tools.formats.glm import GLM
from smoe.serve.tools.formats.harmony import HARMONY
from smoe.serve.tools.formats.hermes import HERMES
from smoe.serve.tools.formats.kimi import KIMI
from smoe.serve.tools.formats.minimax import MINIMAX
from smoe.serve.tools.formats.mistral import MISTRAL

FORMATS: tuple[CallFormat, ...] = (HERMES, MISTRAL, DEEPSEEK, KIMI, GLM, MINIMAX, HARMONY)

__all__ = ["FORMATS", "CallFormat"]
