"""The validation table of docs/validation.md, pinned row by row: the planner's error against each
published run, whether dtlib's memory model lets the published layout fit, and where it ranks;
the fit of the two global efficiencies and the leave-one-source-out cross-validation.
A change to the step-time model that moves any row moves this test (and must update the doc:
``python -m dtlib.plan.validation`` prints it)."""
import numpy as np
import pytest

from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY
from dtlib.plan.validation import (GOALS, PUBLISHED, SOURCES, error_grid, errors_by_family, errors_by_kind, fit,
                                   held_out_errors, leave_one_source_out, mean_absolute_error, predict,
                                   validation_table)

# name: (signed relative error, fits by dtlib's memory model, rank among same-software layouts)
EXPECTED = {
    'GPT 1.7B (Narayanan T1)': (0.0947, True, 1),
    'GPT 3.6B (Narayanan T1)': (0.0662, True, 4),
    'GPT 7.5B (Narayanan T1)': (0.0151, True, 27),
    'GPT 18.4B (Narayanan T1)': (0.0220, True, 51),
    'GPT 39.1B (Narayanan T1)': (0.0361, True, 26),
    'GPT 76.1B (Narayanan T1)': (0.0136, True, 7),
    'GPT 145.6B (Narayanan T1)': (-0.0132, True, 6),
    'GPT 310.1B (Narayanan T1)': (-0.0485, True, 4),
    'GPT 529.6B (Narayanan T1)': (-0.0819, True, 4),
    'GPT 1008B (Narayanan T1)': (-0.0925, True, 1),
    'GPT 22B, SP + selective (Korthikanti T5)': (-0.0071, True, 2),
    'GPT 175B, SP + selective (Korthikanti T5)': (0.0900, True, 1),
    'GPT 530B, SP + selective (Korthikanti T5)': (0.1730, True, 1),
    'GPT 1T, SP + selective (Korthikanti T5)': (0.1983, True, 1),
    'BLOOM 176B (BigScience)': (-0.0172, True, 9),
    'Llama 3.1 8B, FSDP 8, eager (torchtitan T1)': (0.0043, True, 1),
    'Llama 3.1 8B, FSDP 8, compile (torchtitan T1)': (-0.0119, True, 1),
    'Llama 3.1 8B, FSDP 8, compile + Float8 (torchtitan T1)': (0.0338, True, 1),
    'Llama 3.1 8B, FSDP 128, eager (torchtitan T3)': (0.0342, True, 1),
    'Llama 3.1 8B, FSDP 128, compile (torchtitan T3)': (0.0133, True, 1),
    'Llama 3.1 8B, FSDP 128, compile + Float8 (torchtitan T3)': (0.0553, True, 1),
    'Llama 3.1 70B, FSDP 32 x TP 8, compile + Float8 (torchtitan T4)': (-0.0467, True, 96),
    'Llama 3.1 70B, FSDP 32 x TP 8, bfloat16, vanilla TP (torchtitan asyncTP)': (-0.0217, True, 68),
    'Llama 3.1 70B, FSDP 32 x TP 8, bfloat16, async TP (torchtitan asyncTP)': (0.0483, True, 8),
    'Llama 3.1 70B, FSDP 32 x TP 8, float8 tensorwise, vanilla TP (torchtitan asyncTP)': (-0.0241, True, 96),
    'Llama 3.1 70B, FSDP 32 x TP 8, float8 tensorwise, async TP (torchtitan asyncTP)': (0.0442, True, 15),
    'Llama 3.1 8B, FSDP 8 x TP 8, bfloat16, vanilla TP (torchtitan asyncTP)': (0.1369, True, 25),
    'Llama 3.1 8B, FSDP 8 x TP 8, bfloat16, async TP (torchtitan asyncTP)': (0.2740, True, 4),
    'Llama 3.1 8B, FSDP 8 x TP 8, float8 tensorwise, vanilla TP (torchtitan asyncTP)': (0.1581, True, 26),
    'Llama 3.1 8B, FSDP 8 x TP 8, float8 tensorwise, async TP (torchtitan asyncTP)': (0.3565, True, 7),
    'llama3-8b FP8-CS, 8 x H100 (Megatron-Bridge 25.11)': (-0.0769, True, 11),
    'llama3-70b FP8-CS, 64 x H100 (Megatron-Bridge 25.11)': (-0.0492, True, 36),
    'llama3-405b FP8-CS, 1024 x H100 (Megatron-Bridge 25.11)': (0.0965, True, 5),
    'llama3-8b FP8-CS, 8 x B200 (Megatron-Bridge 25.11)': (-0.0052, True, 2),
    'llama3-8b FP8-MX, 8 x B200 (Megatron-Bridge 25.11)': (0.0319, True, 2),
    'llama3-405b FP8-CS, 128 x B200 (Megatron-Bridge 25.11)': (0.0726, True, 9),
    'llama3-405b FP8-MX, 128 x B200 (Megatron-Bridge 25.11)': (0.1362, True, 9),
    'GPT3-5B FP8, 64 x H100 (NeMo 24.07)': (0.1214, True, 4),
    'GPT3-20B FP8, 64 x H100 (NeMo 24.07)': (-0.0042, True, 373),
    'GPT3-175B FP8, 128 x H100 (NeMo 24.07)': (0.0144, True, 152),
    'GPT3-175B FP8, 512 x H100 (NeMo 24.07)': (-0.0502, True, 88),
    'LLAMA2-7B FP8, 8 x H100 (NeMo 24.07)': (0.0434, True, 17),
    'LLAMA2-13B FP8, 16 x H100 (NeMo 24.07)': (-0.0823, True, 1226),
    'LLAMA2-70B FP8, 64 x H100 (NeMo 24.07)': (0.0119, True, 410),
    'LLAMA3-8B FP8, 8 x H100 (NeMo 24.07)': (0.0910, True, 16),
    'LLAMA3-70B FP8, 64 x H100 (NeMo 24.07)': (0.0648, True, 140),
    'LLAMA2-7B FP8 seq 4K, 4 x H100, CP 1 (NeMo long context)': (0.1004, True, 1),
    'LLAMA2-7B FP8 seq 8K, 8 x H100, CP 1 (NeMo long context)': (0.1024, True, 10),
    'LLAMA2-7B FP8 seq 16K, 16 x H100, CP 1 (NeMo long context)': (0.1880, True, 3),
    'LLAMA2-7B FP8 seq 32K, 32 x H100, CP 2 (NeMo long context)': (0.1926, True, 3),
    'LLAMA2-7B FP8 seq 64K, 64 x H100, CP 2 (NeMo long context)': (0.2085, True, 6),
    'LLAMA2-7B FP8 seq 128K, 128 x H100, CP 4 (NeMo long context)': (0.0487, True, 51),
    'LLAMA2-7B FP8 seq 256K, 256 x H100, CP 8 (NeMo long context)': (0.0050, True, 6),
    'LLAMA2-7B FP8 seq 512K, 512 x H100, CP 16 (NeMo long context)': (-0.0272, True, 8),
    'LLAMA2-7B FP8 seq 1024K, 1024 x H100, CP 32 (NeMo long context)': (-0.0187, True, 1),
    'GPT3-175B FP8, 512 x B200 (NeMo 25.02)': (-0.0045, True, 55),
    'LLAMA3-8B FP8, 8 x B200 (NeMo 25.02)': (0.1713, True, 1),
    'LLAMA3-70B FP8, 64 x B200 (NeMo 25.02)': (0.1340, True, 42),
    'LLAMA3-405B FP8, 128 x B200 (NeMo 25.02)': (0.1053, True, 11),
    'Mixtral-8x7B FP8, 64 x B200 (NeMo 25.02)': (-0.0412, True, 44),
    'Mixtral-8x22B FP8, 256 x B200 (NeMo 25.02)': (-0.0093, True, 39),
    'GPT3-175B FP8, 128 x GB200 (NeMo 25.04)': (0.0113, True, 46),
    'LLAMA3-8B FP8, 8 x GB200 (NeMo 25.04)': (-0.0404, True, 2),
    'LLAMA3-70B FP8, 64 x GB200 (NeMo 25.04)': (0.0929, True, 1),
    'LLAMA3-405B FP8, 128 x GB200 (NeMo 25.04)': (0.1416, True, 16),
    'Mixtral-8x7B FP8, 64 x GB200 (NeMo 25.04)': (0.1393, True, 2),
    'Mixtral-8x22B FP8, 256 x GB200 (NeMo 25.04)': (-0.0078, True, 112),
    'MPT-70B seq 2048, 512 x H100, bf16 (llm-foundry)': (0.0074, True, 1),
    'MPT-70B seq 2048, 128 x H100, bf16 (llm-foundry)': (-0.0411, True, 1),
    'MPT-30B seq 2048, 128 x H100, bf16 (llm-foundry)': (-0.0149, True, 1),
    'MPT-13B seq 2048, 128 x H100, bf16 (llm-foundry)': (-0.0439, True, 1),
    'MPT-7B seq 2048, 128 x H100, bf16 (llm-foundry)': (0.1163, True, 1),
    'MPT-3B seq 2048, 128 x H100, bf16 (llm-foundry)': (0.1119, True, 1),
    'MPT-1B seq 2048, 128 x H100, bf16 (llm-foundry)': (0.1457, True, 1),
    'MPT-13B seq 2048, 8 x H100, bf16 (llm-foundry)': (0.2735, True, 1),
    'MPT-7B seq 8192, 8 x H100, bf16 (llm-foundry)': (-0.0526, True, 1),
    'MPT-1B seq 32768, 8 x H100, bf16 (llm-foundry)': (0.0615, True, 1),
    'MPT-3B seq 512, 8 x H100, bf16 (llm-foundry)': (0.0847, True, 1),
    'MPT-3B seq 2048, 8 x H100, fp8 (llm-foundry)': (0.2025, True, 1),
    'MPT-1B seq 8192, 8 x H100, fp8 (llm-foundry)': (0.1646, True, 2),
    'MPT-70B seq 2048, 64 x A100, bf16 (llm-foundry)': (-0.1637, True, 1),
    'MPT-30B seq 2048, 8 x A100, bf16 (llm-foundry)': (-0.1984, True, 1),
    'MPT-13B seq 2048, 8 x A100, bf16 (llm-foundry)': (-0.0299, True, 1),
    'MPT-7B seq 2048, 8 x A100, bf16 (llm-foundry)': (-0.0968, True, 2),
    'MPT-1B seq 2048, 8 x A100, bf16 (llm-foundry)': (-0.0614, True, 2),
    'Llama 3.1 8B, FSDP 32, compile + Float8, H200 (Trainy)': (-0.0429, True, 1),
    'Llama 3.1 8B, FSDP 64, compile + Float8, H200 (Trainy)': (-0.0266, True, 1),
    'GPT 175B ZeRO-3, 256 x A100 (DeepSpeed Azure 2022)': (-0.1023, True, 1),
    'GPT 1T ZeRO-3, 1024 x A100 (DeepSpeed Azure 2022)': (0.1148, True, 1),
    'GPT 2T ZeRO-3, 1024 x A100 (DeepSpeed Azure 2022)': (0.1828, True, 1),
    'Llama 3 405B, 8,192 x H100, seq 8K (Llama 3 T4)': (0.0010, False, 1),
    'Llama 3 405B, 16,384 x H100, seq 8K (Llama 3 T4)': (0.0203, True, 1),
    'Llama 3 405B, 16,384 x H100, seq 128K (Llama 3 T4)': (-0.1741, True, 6),
    'Llama3.1 405B BF16, 128 x GB200 (DGXC 25.07)': (-0.0831, True, 18),
    'Llama3.1 405B BF16, 256 x GB200 (DGXC 25.07)': (-0.0969, True, 23),
    'Llama3.1 405B BF16, 512 x GB200 (DGXC 25.07)': (-0.0995, True, 27),
    'Llama3.1 405B FP8, 128 x GB200 (DGXC 25.07)': (-0.1201, True, 25),
    'Llama3.1 405B FP8, 256 x GB200 (DGXC 25.07)': (-0.1285, True, 35),
    'Llama3.1 405B FP8, 512 x GB200 (DGXC 25.07)': (-0.1374, True, 31),
    'Llama3.1 405B BF16, 512 x H100 (DGXC 25.07)': (0.0110, True, 2),
    'Llama3.1 405B FP8, 512 x H100 (DGXC 25.07)': (-0.0226, True, 5),
    'Nemotron4 15B BF16, 16 x H100 (DGXC 25.07)': (-0.0118, True, 1),
    'Nemotron4 15B FP8, 16 x H100 (DGXC 25.07)': (-0.0871, True, 1),
    'Nemotron4 340B BF16, 256 x H100 (DGXC 25.07)': (-0.0875, True, 3),
    'Nemotron4 340B FP8, 256 x H100 (DGXC 25.07)': (-0.0699, True, 4),
    'Nemotron4 340B BF16, 128 x GB200 (DGXC 25.07)': (-0.2308, True, 8),
    'Nemotron4 340B BF16, 256 x GB200 (DGXC 25.07)': (-0.2331, True, 9),
    'Nemotron4 340B BF16, 512 x GB200 (DGXC 25.07)': (-0.2474, True, 9),
    'Nemotron4 340B FP8, 128 x GB200 (DGXC 25.07)': (-0.2627, True, 15),
    'Nemotron4 340B FP8, 256 x GB200 (DGXC 25.07)': (-0.2821, True, 14),
    'Nemotron4 340B FP8, 512 x GB200 (DGXC 25.07)': (-0.2858, True, 9),
    'Nemotron4 340B BF16, 128 x GB200 strong (DGXC 25.07)': (-0.2020, True, 35),
    'Nemotron4 340B BF16, 256 x GB200 strong (DGXC 25.07)': (-0.2125, True, 35),
    'Nemotron4 340B BF16, 512 x GB200 strong (DGXC 25.07)': (-0.2261, True, 31),
    'Nemotron4 340B FP8, 128 x GB200 strong (DGXC 25.07)': (-0.2265, True, 50),
    'Nemotron4 340B FP8, 256 x GB200 strong (DGXC 25.07)': (-0.2454, True, 48),
    'Nemotron4 340B FP8, 512 x GB200 strong (DGXC 25.07)': (-0.2476, True, 44),
    'DeepSeek V3 BF16, 512 x H100 (DGXC 25.07)': (-0.1928, True, 6),
    'DeepSeek V3 BF16, 1024 x H100 (DGXC 25.07)': (-0.2351, True, 14),
    'DeepSeek V3 BF16, 128 x GB200 (DGXC 25.07)': (-0.6055, True, 1),
    'DeepSeek V3 BF16, 256 x GB200 (DGXC 25.07)': (-0.6216, True, 1),
    'DeepSeek V3 BF16, 512 x GB200 (DGXC 25.07)': (-0.6211, True, 1),
    'Grok1 314B BF16, 128 x GB200 (DGXC 25.07)': (0.0119, True, 24),
    'Grok1 314B BF16, 256 x GB200 (DGXC 25.07)': (0.0025, True, 23),
    'Grok1 314B BF16, 512 x GB200 (DGXC 25.07)': (0.0115, True, 29),
    'Grok1 314B FP8, 128 x GB200 (DGXC 25.07)': (-0.0834, True, 40),
    'Grok1 314B FP8, 256 x GB200 (DGXC 25.07)': (-0.0710, True, 51),
    'Grok1 314B FP8, 512 x GB200 (DGXC 25.07)': (-0.0656, True, 43),
    'Grok1 314B BF16, 512 x H100 (DGXC 25.07)': (0.1428, True, 11),
    'Grok1 314B FP8, 512 x H100 (DGXC 25.07)': (-0.0391, True, 37),
    'Llama4 Maverick BF16, 128 x GB200 (DGXC 25.07)': (-0.0623, True, 9),
    'Llama4 Maverick BF16, 256 x GB200 (DGXC 25.07)': (-0.0720, True, 9),
    'Llama4 Maverick BF16, 512 x GB200 (DGXC 25.07)': (-0.0875, True, 12),
    'Llama4 Maverick FP8, 128 x GB200 (DGXC 25.07)': (-0.1035, True, 12),
    'Llama4 Maverick FP8, 256 x GB200 (DGXC 25.07)': (-0.1227, True, 15),
    'Llama4 Maverick FP8, 512 x GB200 (DGXC 25.07)': (-0.1359, True, 15),
    'Llama4 Maverick BF16, 512 x H100 (DGXC 25.07)': (-0.0157, True, 17),
    'Llama4 Maverick FP8, 512 x H100 (DGXC 25.07)': (-0.1325, True, 31),
    'Llama 3.1 8B FP8, DP 64, 64 x MI325X (AMD, Primus)': (-0.0974, True, 1),
    'Mixtral 8x22B BF16, PP 4 VP 2 EP 8, 64 x MI355X (AMD, Primus)': (0.0390, False, 173),
    'LLAMA3_70B NVFP4, 64 x GB300 (Megatron-Bridge 26.04.01)': (0.0491, True, 3),
    'LLAMA3_70B NVFP4, 64 x GB200 (Megatron-Bridge 26.04.01)': (0.1004, True, 9),
    'LLAMA3.1_405B NVFP4, 256 x GB300 (Megatron-Bridge 26.04.01)': (-0.0172, True, 12),
    'LLAMA3.1_405B NVFP4, 256 x GB200 (Megatron-Bridge 26.04.01)': (-0.2047, True, 10),
    'LLAMA2-7B SFT FP8, 8 x H100 (NeMo 24.07 fine-tuning)': (0.0398, True, 19),
    'LLAMA2-13B SFT FP8, 8 x H100 (NeMo 24.07 fine-tuning)': (-0.1252, True, 252),
    'LLAMA2-70B SFT FP8, 16 x H100 (NeMo 24.07 fine-tuning)': (-0.2009, True, 221),
    'LLAMA2-7B LoRA FP8, 8 x H100 (NeMo 24.07 fine-tuning)': (-0.1652, True, 25),
    'LLAMA2-13B LoRA FP8, 8 x H100 (NeMo 24.07 fine-tuning)': (-0.1915, True, 17),
    'LLAMA2-70B LoRA FP8, 8 x H100 (NeMo 24.07 fine-tuning)': (-0.0498, True, 43),
    'LLAMA3_70B SFT FP8, 32 x GB300 (Megatron-Bridge 26.06)': (-0.0019, True, 5),
    'LLAMA3_70B SFT MXFP8, 32 x GB300 (Megatron-Bridge 26.06)': (0.1155, True, 5),
    'LLAMA3_70B SFT FP8, 32 x GB200 (Megatron-Bridge 26.06)': (-0.0307, True, 63),
    'LLAMA3_70B SFT MXFP8, 32 x GB200 (Megatron-Bridge 26.06)': (0.0424, True, 63),
    'LLAMA3_70B SFT FP8, 32 x H100 (Megatron-Bridge 26.06)': (0.0462, True, 17),
    'LLAMA3_70B LoRA FP8, 8 x GB300 (Megatron-Bridge 26.06)': (-0.1536, True, 12),
    'LLAMA3_70B LoRA MXFP8, 8 x GB300 (Megatron-Bridge 26.06)': (-0.1498, True, 12),
    'LLAMA3_70B LoRA FP8, 8 x GB200 (Megatron-Bridge 26.06)': (-0.0485, True, 3),
    'LLAMA3_70B LoRA MXFP8, 8 x GB200 (Megatron-Bridge 26.06)': (-0.0559, True, 16),
    'LLAMA3_70B LoRA FP8, 8 x H100 (Megatron-Bridge 26.06)': (-0.1093, True, 14),
    'DeepSeek-V3 pre-training, 2,048 x H800 (DeepSeek-V3 report)': (0.0066, False, 75),
    'LLAMA3_8B FP8-CS, 8 x GB300 (Megatron-Bridge 25.11)': (-0.0586, True, 2),
    'LLAMA3_8B FP8-MX, 8 x GB300 (Megatron-Bridge 25.11)': (-0.0208, True, 2),
    'LLAMA3_70B FP8-CS, 64 x GB300 (Megatron-Bridge 25.11)': (0.0893, True, 1),
    'LLAMA3.1_405B FP8-CS, 256 x GB300 (Megatron-Bridge 25.11)': (-0.1103, True, 45),
    'DeepSeekV3 (w/o MTP) BF16, 256 x GB300 (Megatron-Bridge 25.11)': (-0.0458, True, 5),
    'DeepSeekV3 (w/o MTP) FP8-MX, 256 x GB300 (Megatron-Bridge 25.11)': (-0.0057, True, 13),
    'GPT OSS 120B BF16, 64 x GB300 (Megatron-Bridge 25.11)': (0.4948, True, 2),
    'Qwen3_30B_a3B FP8-MX, 8 x GB300 (Megatron-Bridge 25.11)': (-0.1316, True, 2),
    'Qwen3_235B_a22B BF16, 256 x GB300 (Megatron-Bridge 25.11)': (-0.1335, True, 15),
    'LLAMA3_8B FP8-CS, 8 x GB200 (Megatron-Bridge 25.11)': (0.0081, True, 2),
    'LLAMA3_8B FP8-MX, 8 x GB200 (Megatron-Bridge 25.11)': (0.0663, True, 2),
    'LLAMA3_70B FP8-CS, 64 x GB200 (Megatron-Bridge 25.11)': (0.0420, True, 1),
    'LLAMA3.1_405B FP8-CS, 256 x GB200 (Megatron-Bridge 25.11)': (-0.0123, True, 35),
    'DeepSeekV3 (w/o MTP) BF16, 256 x GB200 (Megatron-Bridge 25.11)': (0.0478, True, 4),
    'DeepSeekV3 (w/o MTP) FP8-MX, 256 x GB200 (Megatron-Bridge 25.11)': (-0.0851, True, 12),
    'GPT OSS 120B BF16, 64 x GB200 (Megatron-Bridge 25.11)': (0.4876, True, 3),
    'Qwen3_30B_a3B FP8-MX, 8 x GB200 (Megatron-Bridge 25.11)': (0.0039, True, 1),
    'Qwen3_235B_a22B BF16, 256 x GB200 (Megatron-Bridge 25.11)': (-0.0278, True, 18),
    'DeepSeekV3 (w/ MTP) FP8-MX, 256 x B200 (Megatron-Bridge 25.11)': (0.1343, True, 7),
    'GPT OSS 120B BF16, 64 x B200 (Megatron-Bridge 25.11)': (0.3082, True, 2),
    'Qwen3_30B_a3B FP8-MX, 8 x B200 (Megatron-Bridge 25.11)': (0.3306, True, 3),
    'Qwen3_235B_a22B FP8-MX, 64 x B200 (Megatron-Bridge 25.11)': (0.3400, True, 12),
    'GPT OSS 120B BF16, 64 x H100 (Megatron-Bridge 25.11)': (0.3283, True, 18),
    'Qwen3_30B_a3B FP8-CS, 16 x H100 (Megatron-Bridge 25.11)': (0.8141, True, 9),
    'Qwen3_235B_a22B FP8-CS, 256 x H100 (Megatron-Bridge 25.11)': (0.4572, True, 5),
}

# held-out source: (GEMM, attention efficiency fitted without it, held-out error, in-sample error)
LOSO = {
    'Narayanan 2021': (0.60, 0.50, 0.0484, 0.0484),
    'Korthikanti 2022': (0.60, 0.50, 0.1171, 0.1171),
    'BLOOM 2022': (0.60, 0.50, 0.0172, 0.0172),
    'torchtitan': (0.60, 0.50, 0.0842, 0.0842),
    'Megatron-Bridge': (0.60, 0.50, 0.1579, 0.1579),
    'NeMo 2024': (0.60, 0.55, 0.1060, 0.0764),
    'NeMo 2025': (0.60, 0.50, 0.0749, 0.0749),
    'MosaicML llm-foundry': (0.60, 0.50, 0.1039, 0.1039),
    'Trainy H200': (0.60, 0.50, 0.0348, 0.0348),
    'DeepSpeed Azure 2022': (0.60, 0.50, 0.1333, 0.1333),
    'Llama 3 2024': (0.60, 0.50, 0.0651, 0.0651),
    'DGXC 2025': (0.60, 0.50, 0.1621, 0.1621),
    'AMD Primus 2026': (0.60, 0.50, 0.0682, 0.0682),
    'Megatron-Bridge NVFP4': (0.60, 0.50, 0.0928, 0.0928),
    'NeMo 2024 fine-tuning': (0.60, 0.50, 0.1287, 0.1287),
    'Megatron-Bridge fine-tuning': (0.60, 0.50, 0.0754, 0.0754),
    'DeepSeek-V3 2024': (0.60, 0.50, 0.0066, 0.0066),
}


# GPU family: (runs, in-sample error, held-out error of each run's own fold)
FAMILIES = {
    'a100': (23, 0.0835, 0.0835),
    'h100': (75, 0.1060, 0.1131),
    'b200': (14, 0.1303, 0.1303),
    'gb200': (54, 0.1471, 0.1471),
    'h200': (2, 0.0348, 0.0348),
    'mi325x': (1, 0.0974, 0.0974),
    'mi355x': (1, 0.0390, 0.0390),
    'gb300': (15, 0.1052, 0.1052),
    'h800': (1, 0.0066, 0.0066),
}
# issue 37's goals (validation.GOALS) the pinned numbers miss; docs/validation.md says by how much
MISSED = {"mean_over_sources", "source", "family"}


def _in_trays(run):
    """``run`` with NVLink domains of one 4-GPU tray: every all-to-all across a rack goes over the NICs
    (a lead for DGXC's DeepSeek-V3 GB200 rows, docs/validation.md)."""
    from dataclasses import replace

    gpus = run.cluster.nodes * run.cluster.gpus_per_node
    return replace(run, cluster=replace(run.cluster, nodes=gpus // 4, gpus_per_node=4, nics_per_node=4))


@pytest.fixture(scope="module")
def table():
    return {r["name"]: r for r in validation_table()}


@pytest.fixture(scope="module")
def errors():
    return error_grid()  # the full grid: one step-time pass per run (about a second)


def test_every_row_is_pinned(table):
    assert set(table) == set(EXPECTED) == {r.name for r in PUBLISHED}
    for name, (error, fits, rank) in EXPECTED.items():
        row = table[name]
        assert row["error"] == pytest.approx(error, abs=5e-4), name
        assert row["predicted"] == pytest.approx(row["published"] * (1 + row["error"]), rel=1e-12)
        assert row["fits"] is fits, name
        assert row["rank"] == rank, name


def test_every_published_layout_fits_its_gpus(table):
    """Issue 26: every published layout of the validation set fits at the GPU's full memory, as
    dtlib counts it (the one row whose table contradicts itself is timed as its recipe file ran),
    but Llama 3 405B at 8K: with every pipeline rank counted (issue 35) its rank 1, 8 one-layer
    chunks holding 141 chunk-forwards at the interleaved peak, needs 88.0 GiB on the torchtitan
    stack (eager SwiGLU) where rank 0, all that was counted before, needed 78.8. Llama 3's own
    schedule (Sec. 3.3.2, Fig. 6: a tunable number of micro-batches per round) is not modelled.
    And DeepSeek-V3 under DualPipe: two copies of its stages' weights and pp + 1 stage-micro-batches
    in flight need 81.3 GiB of the H800's 80, where the report caches the inputs of its linear layers
    in FP8 (Sec. 3.3.2, "Low-Precision Storage and Communication"), which dtlib does not model.
    The two BF16 rows of DGXC 25.07 on H100 that missed by under 2% when timed with FP32 gradient buffers
    (Llama 3.1 405B on 512, Nemotron-4 15B on 16) fit with the BF16 ones their recipes' performance mode
    sets (grad_reduce_in_fp32 = False).
    AMD's Mixtral 8x22B on 64 MI355X runs 4 micro-batches of 2 x 8,192 tokens through 4 stages of 2
    virtual chunks: Megatron's interleaved warm-up (10 chunks on the first stage) starts all 8 forward
    chunks before a backward, so dtlib holds 4 micro-batches of 14 layers, 255.5 GiB, beside 45.7 GiB
    of states: 301.2 GiB of the 288. The run fit; what it keeps less of is not found."""
    short = [name for name, row in table.items() if not row["fits"]]
    assert short == ["Llama 3 405B, 8,192 x H100, seq 8K (Llama 3 T4)",
                     "Mixtral 8x22B BF16, PP 4 VP 2 EP 8, 64 x MI355X (AMD, Primus)",
                     "DeepSeek-V3 pre-training, 2,048 x H800 (DeepSeek-V3 report)"]
    for name in ("Llama3.1 405B BF16, 512 x H100 (DGXC 25.07)", "Nemotron4 15B BF16, 16 x H100 (DGXC 25.07)"):
        assert table[name]["memory_gib"] < 80


def test_in_sample_error_is_reported(table):
    mae = mean_absolute_error(list(table.values()))
    assert mae == pytest.approx(sum(abs(e) for e, _, _ in EXPECTED.values()) / len(EXPECTED), abs=1e-4)
    assert mae == pytest.approx(0.1152, abs=5e-4)


def test_errors_by_kind_split_the_runs_into_dense_and_moe(table):
    """Lesson 10's claim: the 142 dense runs within 10% on average, the 44 MoE runs over 1.5 times as far off."""
    kinds = errors_by_kind(list(table.values()))
    moe = {r.name for r in PUBLISHED if r.model.moe_experts}
    assert set(kinds["moe"]["names"]) == moe and len(moe) == 44
    assert set(kinds["dense"]["names"]) == set(table) - moe
    for kind, names in (("dense", set(table) - moe), ("moe", moe)):
        by_hand = sum(abs(EXPECTED[n][0]) for n in names) / len(names)
        assert kinds[kind]["mean_absolute_error"] == pytest.approx(by_hand, abs=1e-4), kind
    assert kinds["dense"]["mean_absolute_error"] < 0.10
    assert kinds["moe"]["mean_absolute_error"] > 1.5 * kinds["dense"]["mean_absolute_error"]


def test_seventeen_sources_and_nine_gpu_families():
    assert len(SOURCES) == 17 and {r.family for r in PUBLISHED} == {"a100", "h100", "h200", "h800", "b200", "gb200",
                                                                   "gb300", "mi325x", "mi355x"}
    for run in PUBLISHED:
        assert "http" in run.reference, run.name  # every run links its source


def test_leave_one_source_out_is_pinned_and_under_ten_percent_on_average(errors):
    loso = leave_one_source_out(errors)
    assert list(loso) == list(SOURCES) == list(LOSO)
    for source, (gemm, attention, held_out, in_sample) in LOSO.items():
        d = loso[source]
        assert (d["gemm"], d["attention"]) == (gemm, attention), source
        assert d["loso_error"] == pytest.approx(held_out, abs=5e-4), source
        assert d["in_sample_error"] == pytest.approx(in_sample, abs=5e-4), source
        assert d["loso_error"] >= d["in_sample_error"] - 1e-12  # a held-out source never does better
    held_out = np.mean([d["loso_error"] for d in loso.values()])
    in_sample = np.mean([d["in_sample_error"] for d in loso.values()])
    assert held_out == pytest.approx(0.0869, abs=5e-4)
    # lesson 10's claims: under 10% held out (issue 26 asks for 8%), within a point of in-sample
    assert held_out <= 0.10 and held_out - in_sample < 0.01


def test_the_defaults_are_the_fitted_minimum(errors):
    """The defaults of dtlib.plan.calibration are the fit on every source (full grid), and the
    optimum is interior: one grid step either side of it in each direction is worse."""
    from dtlib.plan.validation import ATTENTION_GRID, GEMM_GRID, _objective

    assert fit(errors) == (GEMM_EFFICIENCY, ATTENTION_EFFICIENCY)
    objective = _objective(errors, [r.source for r in PUBLISHED], SOURCES)
    i, j = GEMM_GRID.index(GEMM_EFFICIENCY), ATTENTION_GRID.index(ATTENTION_EFFICIENCY)
    for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        assert objective[i + di, j + dj] > objective[i, j]


def test_published_numbers_are_the_sources():
    by_name = {r.name: r for r in PUBLISHED}
    tflops = [by_name[n].published for n in EXPECTED if "Narayanan" in n]
    assert tflops == [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]
    assert [by_name[n].published for n in EXPECTED if "Korthikanti" in n] == [1.10, 13.75, 37.83, 71.49]
    assert by_name["BLOOM 176B (BigScience)"].published == 156
    assert [by_name[n].published for n in EXPECTED if "(torchtitan T" in n] == [5762, 6667, 8532, 5605, 6514, 8380, 829]
    assert [by_name[n].published for n in EXPECTED if "asyncTP" in n] == [597.3, 652.4, 809.8, 942.4,
                                                                             4378, 4809.4, 5078.1, 5570.1]
    assert [by_name[n].published for n in EXPECTED if "Megatron-Bridge 25.11" in n] == [
        14451, 1602, 292, 30624, 29521, 661, 624,
        # the 25.11 table's GB300, GB200, B200 and H100 rows of MoE models and racks (tokens/s/GPU)
        37556, 36108, 4520, 999, 3848, 4357, 18347, 28934, 6131, 31508, 29789, 4312, 813, 3139, 4018, 15876, 23766,
        4916, 2139, 8213, 9299, 3269, 5630, 5275, 1575]
    assert [by_name[n].published for n in EXPECTED if "Megatron-Bridge 26.04.01" in n] == [7296, 4864, 1440, 1184]
    assert [by_name[n].published for n in EXPECTED if "(NeMo 25.0" in n] == [1600, 26006, 3062, 625, 15457, 2232,
                                                                              1804, 33099, 4035, 665, 19275, 2731]
    # Table 1's model sizes follow from the shapes (the paper rounds: 1.65B is printed as 1.7)
    t1 = [by_name[n] for n in EXPECTED if "Narayanan" in n]
    for run, billions in zip(t1, (1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0)):
        assert run.model.num_parameters() / 1e9 == pytest.approx(billions, rel=0.03), run.name
    # Korthikanti's Table 5 MFU follows from the step time: 1T at 71.49 s is 56.3%
    from dtlib.analytic.flops import megatron_flops_per_step
    one_t = by_name["GPT 1T, SP + selective (Korthikanti T5)"]
    mfu = megatron_flops_per_step(512, 2048, 128, 25600, 51200, recompute=False) / (71.49 * 512 * 312e12)
    assert one_t.global_batch == 512 and mfu == pytest.approx(0.563, abs=5e-4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(leave_out="nobody"), "leave_out must be one of"),
])
def test_fit_rejects_unknown_sources(errors, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit(errors, **kwargs)


def test_error_grid_rejects_bad_grids():
    with pytest.raises(ValueError, match="gemm_grid must be a non-empty list of fractions"):
        error_grid((0.0, 0.5), (0.3,))
    with pytest.raises(ValueError, match="attention_grid must be a non-empty list"):
        error_grid((0.8,), ())


def test_every_row_carries_its_unit(table):
    """Lesson 10 printed 27 rows mixing TFLOP/s, seconds and tokens/s with no unit."""
    from dtlib.plan.validation import METRIC_UNITS

    assert {r["unit"] for r in table.values()} == set(METRIC_UNITS.values())
    for r in table.values():
        assert r["unit"] == METRIC_UNITS[r["metric"]], r["name"]


def test_pins_print_what_this_file_pins(table, errors):
    """``python -m dtlib.plan.validation --pins`` prints these two dicts (to re-pin after a model change)."""
    import ast

    from dtlib.plan.validation import _pins

    text = _pins(list(table.values()), leave_one_source_out(errors), errors_by_family(errors))
    expected = ast.literal_eval(text[text.index("{"):text.index("}") + 1])
    loso = ast.literal_eval(text[text.index("{", text.index("LOSO")):text.index("}", text.index("LOSO")) + 1])
    families = ast.literal_eval(text[text.index("{", text.index("FAMILIES")):text.rindex("}") + 1])
    assert expected == EXPECTED and loso == LOSO and families == FAMILIES


def test_families_are_pinned_from_each_runs_held_out_fold(errors):
    families = errors_by_family(errors)
    assert list(families) == list(FAMILIES)
    for family, (runs, in_sample, held_out) in FAMILIES.items():
        d = families[family]
        assert d["runs"] == runs == sum(r.family == family for r in PUBLISHED), family
        assert d["in_sample_error"] == pytest.approx(in_sample, abs=5e-4), family
        assert d["loso_error"] == pytest.approx(held_out, abs=5e-4), family
    # the per-run held-out errors are the folds leave_one_source_out scores
    held, loso = held_out_errors(errors), leave_one_source_out(errors)
    for source, d in loso.items():
        mine = [abs(e) for e, r in zip(held, PUBLISHED) if r.source == source]
        assert np.mean(mine) == pytest.approx(d["loso_error"], rel=1e-12), source


def test_the_goals_on_the_pinned_numbers():
    """Issue 37's goals: mean held out over sources <= 8%, no source above 15%, no GPU family above
    12%. Asserted on the pins: the goals met stay met; those missed are named (MISSED)."""
    measured = {"mean_over_sources": np.mean([v[2] for v in LOSO.values()]),
                "source": max(v[2] for v in LOSO.values()),
                "family": max(v[2] for v in FAMILIES.values())}
    assert {goal for goal, limit in GOALS.items() if measured[goal] > limit} == MISSED


def test_the_amd_comparison_is_what_docs_validation_says():
    """docs/validation.md, "AMD": the one MI355X measurement (AMD's CVS), out of the fit, timed +49.8% too
    fast; its FSDP traffic hidden now that the xGMI mesh is modelled (0.71 s exposed on one link)."""
    from dtlib.plan.published import amd_comparison_runs
    (run,) = amd_comparison_runs()
    assert run.source not in SOURCES and run.name not in {r.name for r in PUBLISHED}
    out = predict(run, rank=False)
    assert out["error"] == pytest.approx(0.498, abs=0.005)
    breakdown = out["config"]["breakdown"]
    assert breakdown["dp_comm"] < 0.01 and breakdown["compute"] == pytest.approx(0.377, abs=0.001)
    # the MI355X's matmul ceiling against H100's (MAMF 1,565 / 2,516.6 vs 794.5 / 989.5) explains part of it
    ceiling = (1565 / 2516.6) / (794.5 / 989.5)
    assert predict(run, gemm=0.6 * ceiling, rank=False)["error"] == pytest.approx(0.280, abs=0.005)
    assert predict(run, gemm=0.6 * ceiling, attention=0.5 * ceiling, rank=False)["error"] == pytest.approx(0.212, abs=0.005)


def test_the_dgxc_rows_are_what_docs_validation_says(table, monkeypatch):
    """docs/validation.md, "DGX Cloud Benchmarking 25.07": 45 runs of six tables. On GB200 (timed at
    its sustained clock) Grok-1 within 10%, Llama 4 7-16% and Llama 3.1 9-16% longer than predicted,
    Nemotron-4 at TP 8 25-40%, DeepSeek-V3 about 2.6x with its attention unfused (about 3x if it had run
    the fused kernel it did not have on Blackwell); on H100 the dense and Grok-1 runs within 15%,
    DeepSeek-V3 24-31% longer. Llama
    4 on H100, EP 128 over 64 nodes, is within 16% with NCCL's batched all-to-all rounds (16 latencies a
    call, 0.26 s of its 0.71 s of EP time); with the pairwise exchange's 127 it was 39% too slow. With TP
    communication exposed the twelve weak-scaling dense GB200 rows would be -2..-10%; with the NVLink
    domain of one tray (EP all-to-all over the NICs) DeepSeek-V3's three GB200 rows would be -9..-12%,
    while Grok-1's would be +25..+37% (two leads, not adopted)."""
    from dataclasses import replace

    from dtlib.plan import moe as plan_moe
    rows = {r.name: r for r in PUBLISHED if r.source == "DGXC 2025"}
    assert len(rows) == 45 and all(r.metric == "step_time_s" for r in rows.values())
    slower = {name: table[name]["published"] / table[name]["predicted"] for name in rows}  # step times

    def group(model, family):
        return [x for n, x in slower.items() if n.startswith(model) and f"x {family}" in n]

    for model, family, runs, low, high in (
            ("Grok1", "GB200", 6, 0.98, 1.10), ("Llama4", "GB200", 6, 1.06, 1.16), ("Llama3.1", "GB200", 6, 1.09, 1.16),
            ("Nemotron4 340B", "GB200", 12, 1.25, 1.41), ("DeepSeek", "GB200", 3, 2.5, 2.7),
            ("DeepSeek", "H100", 2, 1.23, 1.31), ("Llama4", "H100", 2, 1.0, 1.16)):
        x = group(model, family)
        assert len(x) == runs and low < min(x) and max(x) < high, (model, family)
    assert len(group("", "GB200")) == 33
    # DeepSeek-V3 on GB200 ran TE's unfused attention (published._DGXC_UNFUSED_MLA); H100 the fused kernel
    deepseek = {n: r for n, r in rows.items() if n.startswith("DeepSeek")}
    assert [r.flash_attention for r in deepseek.values()] == [None, None, False, False, False]
    fused = [run.published / predict(replace(run, flash_attention=None), rank=False)["predicted"]
             for name, run in deepseek.items() if "x GB200" in name]
    assert all(2.9 < x < 3.2 for x in fused)
    h100 = [x for n, x in slower.items() if "x H100" in n and not n.startswith(("Llama4", "DeepSeek"))]
    assert len(h100) == 8 and all(0.86 < x < 1.15 for x in h100)
    run = rows["Llama4 Maverick BF16, 512 x H100 (DGXC 25.07)"]
    ep = predict(run, rank=False)["config"]["breakdown"]["ep_comm"]
    no_latency = replace(run, cluster=replace(run.cluster, inter=replace(run.cluster.inter, latency=0.0)))
    ep_bandwidth = predict(no_latency, rank=False)["config"]["breakdown"]["ep_comm"]
    assert ep == pytest.approx(0.713, abs=0.002) and ep - ep_bandwidth == pytest.approx(0.258, abs=0.002)
    monkeypatch.setattr(plan_moe, "P2P_PER_BATCH", 1)  # the pairwise exchange: one latency per peer
    pairwise = predict(run, rank=False)
    assert pairwise["config"]["breakdown"]["ep_comm"] == pytest.approx(2.50, abs=0.01)
    assert pairwise["error"] == pytest.approx(0.389, abs=0.002)
    monkeypatch.undo()
    weak = [run for name, run in rows.items() if "x GB200" in name and "strong" not in name
            and name.startswith(("Llama3.1", "Nemotron4"))]
    exposed = [predict(replace(run, tp_overlap=0.0), rank=False)["error"] for run in weak]
    assert len(weak) == 12 and -0.10 < min(exposed) and max(exposed) < -0.01

    for model, low, high in (("DeepSeek", -0.13, -0.08), ("Grok1", 0.24, 0.38)):
        tray = [predict(_in_trays(run), rank=False)["error"] for name, run in rows.items()
                if name.startswith(model) and "x GB200" in name]
        assert len(tray) in (3, 6) and low < min(tray) and max(tray) < high, model


def test_what_the_missed_goals_hang_on():
    """docs/validation.md, "What the misses hang on": with three unverified facts assumed (DGXC's
    Nemotron-4 340B GB200 runs with TP communication exposed, its DeepSeek-V3 GB200 all-to-all over the
    NICs, NeMo 24.07's fine-tuning samples packed at 512 tokens), at the fitted defaults, DGXC 2025 and
    GB200 fall under 8% and the mean over sources under 8%; Megatron-Bridge and B200 still miss."""
    from collections import defaultdict
    from dataclasses import replace

    def assumed(run):
        gb200 = run.source == "DGXC 2025" and "x GB200" in run.name
        if gb200 and run.name.startswith("Nemotron4 340B"):
            return replace(run, tp_overlap=0.0)
        if gb200 and run.name.startswith("DeepSeek"):
            return _in_trays(run)
        if run.source == "NeMo 2024 fine-tuning":
            return replace(run, packed_doc_length=512)
        return run

    by_source, by_family = defaultdict(list), defaultdict(list)
    for run in PUBLISHED:
        error = abs(predict(assumed(run), rank=False)["error"])
        by_source[run.source].append(error)
        by_family[run.family].append(error)
    source = {k: float(np.mean(v)) for k, v in by_source.items()}
    family = {k: float(np.mean(v)) for k, v in by_family.items()}
    assert source["DGXC 2025"] == pytest.approx(0.078, abs=0.002)
    assert source["NeMo 2024 fine-tuning"] == pytest.approx(0.079, abs=0.002)
    assert family["gb200"] == pytest.approx(0.077, abs=0.002)
    assert float(np.mean(list(source.values()))) == pytest.approx(0.077, abs=0.002)
    assert source["Megatron-Bridge"] == pytest.approx(0.158, abs=0.002)
    assert family["b200"] == pytest.approx(0.130, abs=0.002)
