"""What ndplan knows about Megatron-LM and MindSpeed-LLM arguments it does not interpret.

Flags the Megatron reader interprets are consumed there. Every other flag falls in one of
three groups: known to change neither memory nor step time as ndplan models them (silent),
known to change memory in a way ndplan cannot represent (a warning with the reason), or
unknown (a warning: ndplan cannot tell whether it matters). Names are written with dashes;
JSON/YAML argument files using argparse ``dest`` names are normalised to them first.
"""

from __future__ import annotations

#: Flags with no effect on what ndplan models: data, logging, checkpoints, learning rate,
#: initialisation, kernel fusions and communication overlap (overlap changes exposed time
#: only, which the step-time model owns through its own overlap parameters).
NO_EFFECT: frozenset[str] = frozenset("""
--adlr-autoresume --adlr-autoresume-interval --allow-ambiguous-pad-tokens
--app-tag-run-name --app-tag-run-version --apply-layernorm-1p --apply-query-key-layer-scaling --apply-rope-fusion
--async-save --async-tensor-model-parallel-allreduce
--attention-softmax-in-fp32 --auto-detect-ckpt-format --barrier-with-l1-time --bert-binary-head
--bias-dropout-fusion --bias-gelu-fusion --bias-swiglu-fusion --calc-ft-timeouts --calculate-per-token-loss
--check-for-large-grads --check-for-nan-in-loss-and-grad --check-for-spiky-loss
--check-weight-hash-across-dp-replicas-interval --clip-grad --clone-scatter-output-in-embedding
--config-logger-dir --create-attention-mask-in-dataloader --cross-entropy-fusion-impl --cross-entropy-loss-fusion
--data-args-path --data-cache-path --data-parallel-random-init --data-path --data-sharding --dataloader-type
--ddp-average-in-collective --ddp-bucket-size --ddp-num-buckets --ddp-pad-buckets-for-high-nccl-busbw
--ddp-reduce-scatter-with-fp32-accumulation --decoupled-lr --decoupled-min-lr
--delay-wgrad-compute --deprecated-use-mcore-models --deterministic-mode --disable-bias-linear-fusion
--disable-straggler-on-startup --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad
--disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs --disable-tp-comm-split-ag --disable-tp-comm-split-rs
--disable-gloo-process-groups --disable-symmetric-registration --distributed-backend
--distributed-timeout-minutes --distributed-timeout-seconds-after-init --embedding-init-method-std
--empty-unused-memory-level --enable-experimental --enable-ft-package --enable-gloo-process-groups
--enable-one-logger --encoder-seq-length --end-weight-decay --eod-mask-loss --eval-interval --eval-iters
--exit-duration-in-mins --exit-interval --exit-on-missing-checkpoint --exit-signal-handler --finetune
--fp8-amax-compute-algo --fp8-amax-history-len --fp8-interval --fp8-margin --fp8-recipe --fp8-wgrad
--full-validation --gradient-accumulation-fusion --gradient-reduce-div-fusion --high-priority-stream-groups
--hysteresis --init-method-std --init-method-xavier-uniform --initial-loss-scale
--inference-rng-tracker --iterations-to-skip --legacy-tokenizer --load --load-main-params-from-ckpt
--local-rank --log-energy --log-interval --log-loss-scale-to-tensorboard --log-memory-to-tensorboard
--log-num-zeros-in-grad --log-params-norm --log-progress --log-straggler --log-throughput
--log-timers-to-tensorboard --log-validation-ppl-to-tensorboard --log-world-size-to-tensorboard --logging-level
--loss-scale --loss-scale-window --lr --lr-decay-iters --lr-decay-samples --lr-decay-style --lr-warmup-fraction
--lr-warmup-init --lr-warmup-iters --lr-warmup-samples --lr-wsd-decay-iters --lr-wsd-decay-samples
--lr-wsd-decay-style --manual-gc --manual-gc-eval --manual-gc-interval --masked-softmax-fusion --merge-file
--mid-level-dataset-surplus --min-loss-scale --min-lr
--mmap-bin-files --mock-data --moe-aux-loss-coeff --moe-deepep-num-sms --moe-enable-deepep
--moe-input-jitter-eps --moe-per-layer-logging --moe-permute-fusion --moe-router-bias-update-rate
--moe-router-dtype --moe-router-enable-expert-bias --moe-router-force-load-balancing --moe-router-fusion
--moe-router-group-topk --moe-router-load-balancing-type --moe-router-num-groups --moe-router-padding-for-fp8
--moe-router-pre-softmax --moe-router-score-function --moe-router-topk-scaling-factor
--moe-shared-expert-overlap --moe-token-dispatcher-type --moe-token-drop-policy --moe-use-legacy-grouped-gemm
--moe-z-loss-coeff --mscale --mscale-all-dim --multiple-validation-sets --nccl-communicator-config-path
--nccl-ub --no-async-tensor-model-parallel-allreduce --no-barrier-with-level-1-timing --no-bias-dropout-fusion
--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-check-for-nan-in-loss-and-grad
--no-clone-scatter-output-in-embedding --no-create-attention-mask-in-dataloader
--no-gradient-reduce-div-fusion --no-initialization --no-load-optim --no-load-rng
--no-log-loss-scale-to-tensorboard --no-manual-gc-eval --no-masked-softmax-fusion --no-mmap-bin-files
--no-one-logger --no-persist-layer-norm --no-rope-fusion --no-save-optim --no-save-rng
--no-scatter-gather-tensors-in-pipeline --non-persistent-ckpt-type --non-persistent-global-ckpt-dir
--non-persistent-local-ckpt-algo --non-persistent-local-ckpt-dir --non-persistent-save-interval --norm-epsilon
--num-dataset-builder-threads --num-workers --object-storage-cache-path --one-logger-async
--one-logger-project --one-logger-run-name --overlap-grad-reduce --overlap-moe-expert-parallel-comm
--overlap-p2p-communication-warmup-flush --overlap-param-gather --overlap-param-gather-with-optimizer-step
--no-align-grad-reduce --no-align-param-gather --override-opt-param-scheduler
--per-split-data-args-path --perform-initialization --persist-layer-norm --pipeline-model-parallel-comm-backend
--pretrained-checkpoint --profile --profile-ranks --profile-step-end --profile-step-start
--record-memory-history --memory-snapshot-path --replication --replication-factor --replication-jump
--rerun-mode --error-injection-rate --error-injection-type --reset-attention-mask --reset-position-ids
--result-rejected-tracker-filename --rope-scaling-factor --rope-type --rotary-base --rotary-interleaved
--rotary-percent --rotary-scaling-factor --rotary-seq-len-interpolation-factor --sample-rate --save
--save-interval --save-retain-interval --scatter-gather-tensors-in-pipeline --seed --skip-train --split
--start-weight-decay --straggler-ctrlr-port --straggler-minmax-count --tensorboard-dir
--tensorboard-log-interval --tensorboard-queue-size --test-data-path --test-mode --tiktoken-num-special-tokens
--tiktoken-pattern --tiktoken-special-tokens --timing-log-level --timing-log-option --tokenizer-metadata
--tokenizer-model --tp-comm-bootstrap-backend --tp-comm-bulk-dgrad --tp-comm-bulk-wgrad
--tp-comm-overlap --tp-comm-overlap-ag --tp-comm-overlap-cfg --tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad
--tp-comm-split-ag --tp-comm-split-rs --train-data-path --train-iters --train-samples --train-sync-interval
--trust-remote-code --use-checkpoint-args --use-checkpoint-opt-param-scheduler
--use-cpu-initialization --use-dist-ckpt --use-flash-attn --use-mcore-models --use-legacy-models
--use-mp-args-from-checkpoint-args --use-nccl-ub --use-persistent-ckpt-worker --use-pytorch-profiler
--use-ring-exchange-p2p --use-rope-scaling --use-sharp --sharp-enabled-group --use-te-activation-func
--use-tokenizer-model-from-checkpoint-args --use-tp-pp-dp-mapping --valid-data-path --vocab-extra-ids
--vocab-file --wandb-entity --wandb-exp-name --wandb-project --wandb-save-dir --weight-decay
--weight-decay-incr-style --adam-beta1 --adam-beta2 --adam-eps --sgd-momentum --muon-momentum
--muon-no-split-qkv --muon-use-nesterov --muon-scale-mode --muon-fp32-matmul-prec --muon-num-ns-steps
--muon-tp-mode --muon-extra-scale-factor --ckpt-format --ckpt-step --ckpt-convert-format --ckpt-convert-save
--ckpt-convert-update-legacy-dist-opt-format --ckpt-fully-parallel-load --ckpt-fully-parallel-save
--no-ckpt-fully-parallel-save --ckpt-assume-constant-structure --dist-ckpt-strictness
--dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable --dist-ckpt-format
--distrib-optim-fully-reshardable-mem-efficient --no-strict-fsdp-dtensor-load --strict-fsdp-dtensor-load
--inprocess-restart --inprocess-max-iterations --inprocess-monitor-thread-interval
--inprocess-monitor-process-interval --inprocess-progress-watchdog-interval --inprocess-heartbeat-interval
--inprocess-soft-timeout --inprocess-hard-timeout --inprocess-heartbeat-timeout --inprocess-barrier-timeout
--inprocess-completion-timeout --inprocess-last-call-wait --inprocess-termination-grace-time
--inprocess-granularity --inprocess-active-world-size --inprocess-empty-cuda-cache --run-workload-inspector-server
--window-attn-skip-freq --window-size --enable-msc --disable-msc --spec --te-rng-tracker --suggested-communication-unit-size
--init-model-with-meta-device --sft --sft-tokenizer-prompt-format
--moe-upcycling-granularity --moe-use-upcycling --moe-apply-probs-on-input --use-fused-weighted-squared-relu
--glu-linear-offset --activation-func-clamp-value --disable-bf16-reduced-precision-matmul --cuda-graph-warmup-steps --use-torch-optimizer-for-cpu-offload
--overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads --no-pin-cpu-params --pin-cpu-grads --pin-cpu-params
--tokenizer-name-or-path --tokenizer-not-use-fast --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb
--use-fused-ring-attention-update --use-mc2 --use-ascend-mc2 --shape-order --no-shared-storage
--gemm-gradient-accumulation-fusion --moe-permutation-async-comm --use-fused-moe-token-permute-and-unpermute
--moe-alltoall-overlap-comm --topk-group --routed-scaling-factor --norm-topk-prob --seq-aux --prompt-type
--variable-seq-lengths --use-deter-comp --jit-compile --use-fusion-attn-v2 --sparse-mode --pre-tockens
--next-tockens --use-cp-send-recv-overlap --moe-fb-overlap --rope-scaling-beta-fast --rope-scaling-beta-slow
--rope-scaling-mscale --rope-scaling-mscale-all-dim --rope-scaling-original-max-position-embeddings
--rope-scaling-type --no-load-optim --no-load-rng --moe-router-load-balancing-type --distributed-timeout
--use-fused-rotary-pos-emb --position-embedding-type --use-rotary-position-embeddings --no-position-embedding
--add-position-embedding --make-vocab-size-divisible-by --max-position-embeddings --overlap-p2p-comm
--align-grad-reduce --align-param-gather --world-size --rank --data-parallel-size --mtp-loss-scaling-factor
--moe-router-topk-limited-devices --moe-aux-loss-coeff --num-workers
""".split())

#: Prefixes of whole families of such flags (logging, evaluation, data, checkpoint paths...).
NO_EFFECT_PREFIXES: tuple[str, ...] = (
    "--log-", "--tensorboard-", "--wandb-", "--eval-", "--ckpt-", "--dist-ckpt-", "--inprocess-",
    "--retro-", "--one-logger", "--straggler", "--profile", "--lr-", "--adam-", "--muon-", "--rope-scaling-",
    "--inference-", "--rl-", "--grpo-", "--langrl-", "--dino-", "--vision-", "--img-", "--ict-", "--bert-",
    "--biencoder-", "--titles-", "--kitchen-", "--fp8-amax-", "--tp-comm-", "--disable-tp-comm-", "--ddp-",
    "--moe-router-", "--tiktoken-", "--non-persistent-",
)

#: Flags that change memory in a way ndplan does not represent, and why.
UNMODELLED: dict[str, str] = {
    "--distribute-saved-activations": "recomputation inputs split over the tensor-parallel group are not modelled",
    "--microbatch-group-size-per-virtual-pipeline-stage": (
        "the interleaved schedule's micro-batch group is priced at its default, pp: a larger group g holds "
        "(vpp - 1)·(g - pp) more chunk micro-batches on every rank in the warm-up (get_pp_rank_microbatches), "
        "so the estimate reads low"),
    "--defer-embedding-wgrad-compute": (
        "deferred output-layer weight gradients are not modelled: the last stage keeps the output layer's input "
        "and its logits gradient for each deferred micro-batch until the flush, so the estimate reads low"),
    "--fp4-format": "fp4 compute is not modelled",
    "--fp4-param-gather": "fp4 parameter copies are not modelled",
    "--reuse-fp32-param": "MindSpeed's reuse of the fp32 parameter buffer is not modelled",
    "--swap-attention": "MindSpeed's attention-activation swapping is not modelled",
    "--recompute-activation-function": "recomputing only the MLP activation is not modelled",
    "--recompute-activation-function-num-layers": "recomputing only the MLP activation is not modelled",
    "--recompute-in-advance": "MindSpeed's early recomputation is not modelled",
    "--recompute-norm": "recomputing only the norms is not modelled",
    "--recompute-norm-num-layers": "recomputing only the norms is not modelled",
    "--recompute-mtp-norm": "recomputing the MTP norms is not modelled",
    "--recompute-mtp-layer": "recomputing the MTP layers is not modelled",
    "--share-mtp-embedding-and-output-weight": "MTP sharing the embedding and output weights is not modelled",
    "--rampup-batch-size": "a batch-size ramp-up is not modelled; ndplan uses the final global batch",
    "--fp16-lm-cross-entropy": "fp16 logits in the loss are not modelled",
    "--fp32-residual-connection": "fp32 residual activations are not modelled",
    "--heterogeneous-layers-config-path": "heterogeneous per-layer architectures are not modelled",
    "--heterogeneous-layers-config-encoded-json": "heterogeneous per-layer architectures are not modelled",
    "--hybrid-override-pattern": "hybrid Mamba/attention stacks are not modelled",
    "--hybrid-attention-ratio": "hybrid Mamba/attention stacks are not modelled",
    "--hybrid-mlp-ratio": "hybrid Mamba/attention stacks are not modelled",
    "--is-hybrid-model": "hybrid Mamba/attention stacks are not modelled",
    "--moe-extended-tp": "deprecated expert tensor parallelism; use --expert-tensor-parallel-size",
    "--first-last-layers-bf16": "bf16 first/last layers in an fp8 run are not modelled",
    "--num-layers-at-start-in-bf16": "bf16 first/last layers in an fp8 run are not modelled",
    "--num-layers-at-end-in-bf16": "bf16 first/last layers in an fp8 run are not modelled",
    "--enable-full-sharding-in-hsdp": "full sharding inside HSDP replicas is not modelled",
    "--mrope-section": "multimodal rotary embedding is not modelled",
    "--yaml-cfg": "the experimental YAML config is not read; pass its settings as flags",
    "--cp-window-size": "windowed context-parallel attention is not modelled",
    "--qk-l2-norm": "Llama-4 QK L2 norms are not modelled",
    "--softmax-type": "learnable softmax offsets are not modelled",
    "--cuda-graph-impl": "CUDA graphs' static input/output buffers and private memory pool are not modelled",
    "--cuda-graph-scope": "CUDA graphs' static input/output buffers and private memory pool are not modelled",
    "--enable-cuda-graph": "CUDA graphs' static input/output buffers and private memory pool are not modelled",
    "--external-cuda-graph": "CUDA graphs' static input/output buffers and private memory pool are not modelled",
    "--keep-fp8-transpose-cache": "the cached fp8 transposes of the weights are not modelled",
    "--fsdp-double-buffer": "Megatron-FSDP's double-buffered unit allocation is not modelled",
}

#: argparse ``dest`` names whose flag is spelled differently (argument files use ``dest``);
#: value ``(flag, invert)``: ``invert`` means the dest is True when the flag is absent.
DEST_TO_FLAG: dict[str, tuple[str, bool]] = {
    "fp8": ("--fp8-format", False),
    "fp4": ("--fp4-format", False),
    "fp4_param": ("--fp4-param-gather", False),
    "add_bias_linear": ("--disable-bias-linear", True),
    "torch_fsdp2_reshard_after_forward": ("--torch-fsdp2-no-reshard-after-forward", True),
    "overlap_p2p_comm": ("--overlap-p2p-comm", False),
    "use_dist_ckpt_deprecated": ("--use-dist-ckpt", False),
    "deprecated_use_mcore_models": ("--use-mcore-models", False),
    "add_position_embedding": ("--no-position-embedding", True),
    "data_parallel_size": ("--data-parallel-size", False),
    "world_size": ("--world-size", False),
}


def is_no_effect(flag: str) -> bool:
    return flag in NO_EFFECT or flag.startswith(NO_EFFECT_PREFIXES)
