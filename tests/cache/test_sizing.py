import pytest

from cache import cache_size, cache_size_article


def test_article_formula_equals_per_head_for_mha():
    # LLaMA-7B-like: 32 layers, hidden 4096, 32 heads, fp16, 4096 tokens -> 2 GiB
    assert cache_size_article(4096, 32, 4096, "fp16") == 2 * 1024**3
    assert cache_size(4096, 32, 4096, "fp16", num_heads=32) == 2 * 1024**3


def test_gqa_is_smaller_than_the_article_formula():
    # 8 KV heads of 128 dims (LLaMA-2-70B style GQA): the article overestimates 8x
    full = cache_size_article(4096, 80, 8192, "fp16")
    gqa = cache_size(4096, 80, 8192, "fp16", num_heads=64, num_kv_heads=8)
    assert full == 8 * gqa


def test_int4_and_errors():
    assert cache_size(16, 1, 64, "int4", num_heads=1) == 2 * 64 * 16 // 2
    with pytest.raises(ValueError, match="unknown dtype"):
        cache_size(1, 1, 1, "fp8")
    with pytest.raises(ValueError, match="divisible"):
        cache_size(1, 1, 10, num_heads=3)
