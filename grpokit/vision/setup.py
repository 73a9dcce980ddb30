"""A vision-language model's setup in the trainer, once the model and its processing class are known."""

from __future__ import annotations

from ..validation import refusal


def setup_vision(model, processing_class, args, train_dataset, eval_dataset, *, rollout_func=None,
                 peft_config=None) -> None:
    """A vision-language model's setup, once the model and its processing class are known: datasets with images need
    a VLM and its processor (one error line otherwise: the model would train on the text alone), and a generation
    path that sends the images; ``ddp_find_unused_parameters`` on for a VLM (TRL's rule: a text-only batch leaves the
    vision tower without gradients); ``freeze_vision`` freezes its vision tower and projector in full fine-tuning."""
    from ..data import dataset_items, is_iterable_dataset
    from ..training.policy import is_peft
    from .detection import check_vision_setup, is_processor, is_vlm
    from .images import image_column

    for name, dataset in dataset_items(train_dataset, eval_dataset):
        columns = getattr(dataset, "column_names", None)
        if columns is None and not is_iterable_dataset(dataset) and hasattr(dataset, "__len__") and len(dataset):
            columns = list(dataset[0]) if isinstance(dataset[0], dict) else None
        has_images = image_column(columns) is not None
        check_vision_setup(model, processing_class, has_images, dataset=name)
        if has_images and rollout_func is not None:
            raise ValueError(f"{name} has images, which rollout_func does not support (it returns token ids without "
                             "the image tensors, so the model would train on the text alone); drop rollout_func or "
                             "the image column")
    if is_processor(processing_class):
        if args.use_transformers_continuous_batching:
            raise ValueError("use_transformers_continuous_batching=True is not supported with a vision-language "
                             "model's processor (as in TRL); use the default generation or use_vllm=True")
        grad_ckpt = args.gradient_checkpointing and (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        if args.ddp_find_unused_parameters is None and not grad_ckpt:
            args.ddp_find_unused_parameters = True
    if args.freeze_vision:
        if not is_vlm(model):
            raise refusal("freeze_vision", True, f"{type(model).__name__} is not a vision-language model; leave it "
                          "False")
        if peft_config is None and not is_peft(model):
            from .adapters import freeze_vision

            freeze_vision(model)

