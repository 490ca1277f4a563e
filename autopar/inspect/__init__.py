"""Reading plans: ``show``, ``compare``, ``explain``, the HTML report, the simulated trace, export to
native PyTorch, and the collectives a plan predicts.

The top of the library's layers: it may import any layer below it, and none imports it
(``docs/architecture.md``, "Layers").
"""

from autopar.core.plan import register_view
from autopar.inspect.explain import render
from autopar.inspect.show import summarize

register_view("summary", summarize)
register_view("explain", lambda plan, name: render(plan.to_dict(), name))
