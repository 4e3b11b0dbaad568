"""Vision-language models: which checkpoints run and how their config splits (:mod:`.config`), the vision towers
(:mod:`.towers`), multimodal rotary positions (:mod:`.mrope`) and small random models made offline (:mod:`.tiny`)."""
