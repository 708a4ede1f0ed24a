"""Which classes' layout maps lay out the model a cell builds on a mesh (`--shard model`):
read from the names the cell uses, looked up in the user's namespace, never found by
walking the interpreter's stack (`training.cell_code.layout_owners`)."""

import types

from tpu_magic.training.cell_code import assigned_before, dotted_names_in, layout_owners


class GemmaBackbone:  # stands for KerasHub's: a class that offers its own layout map
    @classmethod
    def get_layout_map(cls, mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"):
        return {}


class LlamaBackbone(GemmaBackbone):
    pass


class GemmaCausalLM:  # a task: its backbone's class says the layouts
    backbone_cls = GemmaBackbone


class LlamaCausalLM:
    backbone_cls = LlamaBackbone


class MistralBackbone:  # no layout map: its variables' layouts come from their shapes
    pass


class MistralCausalLM:
    backbone_cls = MistralBackbone


def _keras_hub():
    models = types.ModuleType("keras_hub.models")
    for cls in (GemmaBackbone, LlamaBackbone, GemmaCausalLM, MistralBackbone, MistralCausalLM):
        setattr(models, cls.__name__, cls)
    hub = types.ModuleType("keras_hub")
    hub.models = models
    return hub


CELL = """
backbone = keras_hub.models.GemmaBackbone(vocabulary_size=512, num_layers=2)
lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
backbone.enable_lora(rank=4)
lm.fit(x, y, batch_size=8)
"""


def test_the_dotted_names_a_cell_reads_in_the_order_of_its_code():
    names = dotted_names_in(CELL)
    assert names.index("keras_hub.models.GemmaBackbone") < \
        names.index("keras_hub.models.GemmaCausalLM") < names.index("lm.fit")
    assert {"keras_hub", "keras_hub.models", "x", "y", "backbone.enable_lora"} <= set(names)
    assert names.index("lm") > names.index("keras_hub.models.GemmaCausalLM")  # read at fit
    assert dotted_names_in("def broken(:") == ()


def test_a_backbone_the_cell_names_through_its_module_owns_the_layouts():
    assert layout_owners(CELL, {"keras_hub": _keras_hub()}) == [GemmaBackbone]


def test_a_task_class_owns_them_through_its_backbone_cls():
    cell = 'lm = keras_hub.models.GemmaCausalLM.from_preset("gemma2_2b_en")\n'
    assert layout_owners(cell, {"keras_hub": _keras_hub()}) == [GemmaBackbone]
    imported = "from keras_hub.models import GemmaCausalLM\nlm = GemmaCausalLM.from_preset('x')\n"
    assert layout_owners(imported, {"GemmaCausalLM": GemmaCausalLM}) == [GemmaBackbone]


def test_a_model_the_namespace_holds_owns_them_by_its_class_and_its_backbone():
    class CausalLM:  # a task class without its own backbone_cls (`CausalLM.from_preset`)
        def __init__(self):
            self.backbone = LlamaBackbone()

    cell = "gemma_lm.backbone.enable_lora(rank=4)\ngemma_lm.fit(x, y)\n"
    assert layout_owners(cell, {"gemma_lm": CausalLM()}) == [LlamaBackbone]
    assert layout_owners("lm.fit(x)\n", {"lm": GemmaCausalLM()}) == [GemmaBackbone]


def test_classes_without_a_layout_map_and_names_not_there_yet_own_nothing():
    cell = CELL.replace("Gemma", "Mistral")
    assert layout_owners(cell, {"keras_hub": _keras_hub()}) == []
    assert layout_owners(CELL, {}) == []  # `import keras_hub` has not run yet
    assert layout_owners("keras.layers.Dense(4)(x)\n", {"keras": types.ModuleType("keras"),
                                                        "x": object()}) == []


def test_each_owner_once_in_the_order_the_cell_names_them():
    cell = ("a = keras_hub.models.LlamaBackbone()\nb = keras_hub.models.GemmaBackbone()\n"
            "c = keras_hub.models.GemmaCausalLM(backbone=b)\n")
    assert layout_owners(cell, {"keras_hub": _keras_hub()}) == [LlamaBackbone, GemmaBackbone]


def test_an_objects_attributes_are_not_read_on_the_way_and_a_failing_property_is_no_owner():
    class Touchy:
        read = []

        @property
        def backbone(self):
            raise RuntimeError("not built")

        @property
        def models(self):
            Touchy.read.append("models")
            return _keras_hub().models

    assert layout_owners("t.models.GemmaBackbone()\n", {"t": Touchy()}) == []
    assert Touchy.read == []


def test_the_python_a_magic_runs_is_read_too():
    cell = "get_ipython().run_line_magic('time', 'lm = keras_hub.models.GemmaCausalLM()')\n"
    assert layout_owners(cell, {"keras_hub": _keras_hub()}) == [GemmaBackbone]


def test_an_object_a_name_held_before_the_cell_assigns_it_again_owns_nothing():
    # the previous cell's `lm` (a Gemma) while this cell builds its own (a Mistral): the
    # Gemma's map must not lay out the Mistral's variables
    cell = "lm = keras_hub.models.MistralCausalLM(backbone=None)\nlm.fit(x, y)\n"
    namespace = {"keras_hub": _keras_hub(), "lm": GemmaCausalLM()}
    before = assigned_before(cell, namespace)
    assert before == {"lm": namespace["lm"]}
    assert layout_owners(cell, namespace, before) == []
    namespace["lm"] = LlamaCausalLM()  # once the cell assigned it, its own object counts
    assert layout_owners(cell, namespace, before) == [LlamaBackbone]
    assert layout_owners(cell, {"lm": GemmaCausalLM()}) == [GemmaBackbone]  # not assigned


def test_the_names_a_cell_assigns():
    cell = ("import keras_hub as hub\nfrom a.b import c\nfor i in range(2):\n    pass\n"
            "def f():\n    pass\nclass K:\n    pass\nx, y = 1, 2\nz.w = 3\n")
    namespace = {name: object() for name in ("hub", "c", "i", "f", "K", "x", "y", "z")}
    assert set(assigned_before(cell, namespace)) == {"hub", "c", "i", "f", "K", "x", "y"}
