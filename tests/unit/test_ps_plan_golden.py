"""csrun's parameter-server plan against TensorFlow 2.21's, case by recorded case.

``tests/golden/ps_plan.json`` holds what TF 2.21 did (recorded by
``tests/golden/record_ps_plan.py``, which says how): its partitioners called directly
(``call`` cases) and the shards, ps tasks and partitioner calls of variables created in a
``ParameterServerStrategy`` scope (``plan`` cases: round-robin placement,
``colocate_vars_with``, Fixed/MinSize/MaxSize and custom partitioners, scalars, zero-
and one-row variables). Each case is replayed through csrun (``tests/helpers/ps_plan.py``
names the API it calls) and must give TF's answer: the same result, or shards on the
same ps tasks after the same partitioner calls; where TF raises one of its own checks,
the same exception type (messages are csrun's own); where TF crashes on an input it
does not check (``crash`` in the golden), a ``ValueError`` or ``TypeError``.

The cases csrun answers differently today are ``KNOWN_DIFFERENCES`` (strict xfails, each
with TF's answer and csrun's): fixing one makes its xfail fail, and the entry goes; one
kept on purpose belongs in docs/tf-parity.md as a deviation, with its reason.
"""

from __future__ import annotations

import copy

import pytest

from tests.helpers.ps_plan import cases, check, csrun_call, csrun_plan, golden


def _group(reason: str, *ids: str) -> dict[str, str]:
    return {case_id: reason for case_id in ids}


# Why each known difference differs: TF 2.21's answer, then csrun's today (the
# comment above each says more).
# issue 37's case, 3 ps: TF [0],[0],[1],[2],[1],[0], csrun [0],[0],[2],[0],[2],[2]:
# every later variable moves
COLOCATED_COUNTED = (
    "colocate_vars_with: TF leaves a colocated variable out of the round-robin, csrun "
    "counts it")
# TF 2.21's eager colocate_with reads the ShardedVariable on the coordinator and creates
# the variable there, not counted in the round-robin; csrun also counts it
COLOCATED_WITH_PARTITIONED = (
    "colocated with a partitioned variable: TF puts it on the coordinator ('chief'), "
    "csrun on the target's first shard's ps")
# TF: whole with no partitioner, MinSize or a custom [1]; FixedShards: ValueError
# 'variable_partitioner must return ... (non-zero), got: [0, 1]'; a custom [2]:
# ZeroDivisionError (a crash: csrun should refuse with a ValueError)
ZERO_ROWS = (
    "zero rows: TF places the variable whole (FixedShards: ValueError), csrun raises "
    "IndexError in Layout.of")
# TF calls the partitioner with [1, n] and keeps the variable whole whatever it returns
# (min(n, rows) = 1); a partitioner with side effects or checks sees the difference
ONE_ROW_NOT_ASKED = (
    "one row: TF asks the partitioner (then keeps the variable whole), csrun never calls "
    "it")
# TF accepts any list or tuple with a non-zero first element and 1s after it, whatever
# its length, and takes min(n, rows) shards; [True, 1] counts as 1 and [1] keeps the
# variable whole; csrun wants exactly [n, 1, ...] of the variable's rank
CUSTOM_RESULTS_REFUSED = (
    "custom result TF accepts ([2] or [2, 1, 1] for [4, 4]; [2, 1] for a 1-D variable; "
    "[True, 1]), csrun refuses (ValueError)")
# TF: 'variable_partitioner must return a list/tuple whose elements are 1 besides the
# first element (non-zero), got: None'; csrun: 'NoneType' object is not iterable
NONE_RESULT = "custom partitioner returning None: TF ValueError, csrun TypeError"
# TF calls any callable (shape, dtype); csrun calls partitioner.num_shards, which a
# function lacks
PLAIN_FUNCTION = (
    "a plain function as partitioner: TF calls it, csrun needs a Partitioner subclass "
    "(AttributeError)")
# TF refuses only when a variable is created: ValueError for 0, TypeError for -1 (an
# empty ShardedVariable); the plan cases agree, the direct calls differ
FIXED_NONPOSITIVE = (
    "FixedShardsPartitioner(0) or (-1): TF builds it and returns [0, 1] / [-1, 1], csrun "
    "refuses it when built (ValueError)")
# TF: range(2.5) fails ('float' object cannot be interpreted as an integer) once a
# variable has more rows than the count
FLOAT_SHARDS = (
    "FixedShardsPartitioner(2.5) or (2.0): TF returns [2.5, 1] and fails on a variable "
    "(TypeError), csrun makes it 2 silently")
# TF: min('2', rows): '<' not supported between instances of 'int' and 'str'
STRING_SHARDS = (
    "FixedShardsPartitioner('2'): TF fails at the first call (TypeError), csrun makes it "
    "2 silently")
# TF MinSize: 'Cannot partition variable along axis 0 when shape is only ()'; csrun:
# tuple index out of range, not a clear refusal (inside a strategy both skip scalars)
SCALAR_CALL = (
    "a scalar shape given to a partitioner directly: TF IndexError (FixedShards, a crash) "
    "or ValueError (MinSize), csrun IndexError")
# TF: [1, 2] for FixedShards(2) with axis=1 on [10, 3]; MinSize past the last axis:
# ValueError
AXIS_KEYWORD = (
    "partitioner(shape, dtype, axis=k): TF splits along axis k, csrun has no axis keyword "
    "(TypeError)")
# also 2.5, 3.5 and 100.5
FRACTIONAL_MIN_BYTES = (
    "MinSizePartitioner(min_shard_bytes=1.5): TF divides by the float and rounds up (67 "
    "shards of 100 bytes), csrun int()s it first (100)")
# TF checks it is at least 1 (ValueError) and uses it for string variables only
BYTES_PER_STRING = (
    "MinSizePartitioner(bytes_per_string=...): TF accepts it, csrun has no such keyword "
    "(TypeError)")
# TF: as few shards as keep each within max_shard_bytes (rounded down to whole rows, at
# least one row), at most max_shards (0 or None: no limit); zero rows:
# ZeroDivisionError, a crash
MAX_SIZE = "MaxSizePartitioner: TF has it, csrun.core has none (AttributeError)"

KNOWN_DIFFERENCES: dict[str, str] = {
    **_group(COLOCATED_COUNTED,
             "plan/ps2/colocate/issue_37",
             "plan/ps2/colocate/interleaved",
             "plan/ps3/colocate/issue_37",
             "plan/ps3/colocate/chain",
             "plan/ps3/colocate/many_on_first",
             "plan/ps3/colocate/interleaved",
             "plan/ps4/colocate/issue_37",
             "plan/ps4/colocate/chain",
             "plan/ps4/colocate/interleaved",
             "plan/ps2/colocate/fixed(2)/with_whole",
             "plan/ps2/colocate/min_size/with_whole",
             "plan/ps3/colocate/fixed(2)/with_whole",
             "plan/ps3/colocate/min_size/with_whole"),
    **_group(COLOCATED_WITH_PARTITIONED,
             "plan/ps2/colocate/fixed(2)/with_partitioned",
             "plan/ps3/colocate/fixed(2)/with_partitioned"),
    **_group(ZERO_ROWS,
             "plan/ps1/round_robin/zero_rows",
             "plan/ps2/round_robin/zero_rows",
             "plan/ps3/round_robin/zero_rows",
             "plan/ps4/round_robin/zero_rows",
             "plan/ps2/colocate/scalar_and_zero_rows",
             "plan/ps3/colocate/scalar_and_zero_rows",
             "plan/ps4/colocate/scalar_and_zero_rows",
             "plan/ps3/fixed(1)/rows0",
             "plan/ps3/fixed(2)/rows0",
             "plan/ps3/fixed(3)/rows0",
             "plan/ps3/fixed(4)/rows0",
             "plan/ps3/fixed(5)/rows0",
             "plan/ps3/fixed(7)/rows0",
             "plan/ps3/min_size(1,100)/[0, 4]/float32",
             "plan/ps3/min_size(1.5,100)/[0, 4]/float32",
             "plan/ps3/min_size(2.5,100)/[0, 4]/float32",
             "plan/ps3/min_size(4,3)/[0, 4]/float32",
             "plan/ps3/min_size(16,4)/[0, 4]/float32",
             "plan/ps3/min_size(100,100)/[0, 4]/float32",
             "plan/ps3/min_size(100.5,100)/[0, 4]/float32",
             "plan/ps3/min_size(262144,4)/[0, 4]/float32",
             "plan/ps2/custom([2])/[0, 4]",
             "plan/ps2/custom([1])/[0, 4]"),
    **_group(ONE_ROW_NOT_ASKED,
             "plan/ps3/fixed(1)/rows1",
             "plan/ps3/fixed(2)/rows1",
             "plan/ps3/fixed(3)/rows1",
             "plan/ps3/fixed(4)/rows1",
             "plan/ps3/fixed(5)/rows1",
             "plan/ps3/fixed(7)/rows1",
             "plan/ps1/fixed(3)/sequence",
             "plan/ps2/fixed(3)/sequence",
             "plan/ps3/fixed(3)/sequence",
             "plan/ps4/fixed(3)/sequence",
             "plan/ps2/fixed(2.5)/one_row_only",
             "plan/ps2/fixed(2.0)/one_row_only",
             "plan/ps3/min_size(1,100)/[1, 8]/float32",
             "plan/ps3/min_size(1.5,100)/[1, 8]/float32",
             "plan/ps3/min_size(2.5,100)/[1, 8]/float32",
             "plan/ps3/min_size(4,3)/[1, 8]/float32",
             "plan/ps3/min_size(16,4)/[1, 8]/float32",
             "plan/ps3/min_size(100,100)/[1, 8]/float32",
             "plan/ps3/min_size(100.5,100)/[1, 8]/float32",
             "plan/ps3/min_size(262144,4)/[1, 8]/float32",
             "plan/ps2/custom([2])/[1, 4]",
             "plan/ps2/custom([1])/[1, 4]"),
    **_group(CUSTOM_RESULTS_REFUSED,
             "plan/ps2/custom([2])/[4, 4]",
             "plan/ps2/custom([2, 1, 1])/[4, 4]",
             "plan/ps2/custom([2, 1, 1])/[1, 4]",
             "plan/ps2/custom([2, 1, 1])/[]",
             "plan/ps2/custom([2, 1, 1])/[6]",
             "plan/ps2/custom([2, 1])/[4, 4]",
             "plan/ps2/custom([2, 1])/[1, 4]",
             "plan/ps2/custom([2, 1])/[]",
             "plan/ps2/custom([2, 1])/[6]",
             "plan/ps2/custom([3, 1])/[4, 4]",
             "plan/ps2/custom([3, 1])/[1, 4]",
             "plan/ps2/custom([3, 1])/[]",
             "plan/ps2/custom([3, 1])/[6]",
             "plan/ps2/custom([True, 1])/[4, 4]",
             "plan/ps2/custom([True, 1])/[1, 4]",
             "plan/ps2/custom([True, 1])/[0, 4]",
             "plan/ps2/custom([True, 1])/[]",
             "plan/ps2/custom([True, 1])/[6]",
             "plan/ps2/custom([1])/[4, 4]",
             "plan/ps2/custom([5, 1, 1, 1])/[4, 4]",
             "plan/ps2/custom([5, 1, 1, 1])/[1, 4]",
             "plan/ps2/custom([5, 1, 1, 1])/[]",
             "plan/ps2/custom([5, 1, 1, 1])/[6]"),
    **_group(NONE_RESULT,
             "plan/ps2/custom(None)/[4, 4]",
             "plan/ps2/custom(None)/[1, 4]",
             "plan/ps2/custom(None)/[0, 4]",
             "plan/ps2/custom(None)/[]",
             "plan/ps2/custom(None)/[6]"),
    **_group(PLAIN_FUNCTION,
             "plan/ps2/custom_plain_function([2, 1])",
             "plan/ps2/custom_plain_function([2])"),
    **_group(FIXED_NONPOSITIVE,
             "call/fixed(0)/[10, 3]/float32",
             "call/fixed(0)/[7]/float32",
             "call/fixed(0)/[1, 4]/float32",
             "call/fixed(0)/[0, 4]/float32",
             "call/fixed(0)/[4, 2, 3]/float32",
             "call/fixed(0)/[2, 5]/float32",
             "call/fixed(0)/[4000000, 32]/float32",
             "call/fixed(-1)/[10, 3]/float32",
             "call/fixed(-1)/[7]/float32",
             "call/fixed(-1)/[1, 4]/float32",
             "call/fixed(-1)/[0, 4]/float32",
             "call/fixed(-1)/[4, 2, 3]/float32",
             "call/fixed(-1)/[2, 5]/float32",
             "call/fixed(-1)/[4000000, 32]/float32"),
    **_group(FLOAT_SHARDS,
             "call/fixed(2.5)/[10, 3]/float32",
             "call/fixed(2.5)/[7]/float32",
             "call/fixed(2.5)/[4, 2, 3]/float32",
             "call/fixed(2.5)/[4000000, 32]/float32",
             "call/fixed(2.0)/[10, 3]/float32",
             "call/fixed(2.0)/[7]/float32",
             "call/fixed(2.0)/[4, 2, 3]/float32",
             "call/fixed(2.0)/[2, 5]/float32",
             "call/fixed(2.0)/[4000000, 32]/float32",
             "plan/ps2/fixed(2.5)/one_row_then_rows",
             "plan/ps2/fixed(2.0)/one_row_then_rows"),
    **_group(STRING_SHARDS,
             "call/fixed('2')/[10, 3]/float32",
             "call/fixed('2')/[7]/float32",
             "call/fixed('2')/[1, 4]/float32",
             "call/fixed('2')/[0, 4]/float32",
             "call/fixed('2')/[4, 2, 3]/float32",
             "call/fixed('2')/[2, 5]/float32",
             "call/fixed('2')/[4000000, 32]/float32",
             "plan/ps2/fixed('2')/one_row_then_rows",
             "plan/ps2/fixed('2')/one_row_only"),
    **_group(SCALAR_CALL,
             "call/fixed(1)/[]/float32",
             "call/fixed(2)/[]/float32",
             "call/fixed(3)/[]/float32",
             "call/fixed(5)/[]/float32",
             "call/fixed(2.5)/[]/float32",
             "call/fixed(2.0)/[]/float32",
             "call/fixed('2')/[]/float32",
             "call/min_size(4,3)/[]/float32"),
    **_group(AXIS_KEYWORD,
             "call/fixed(2),axis/[10, 3]/float32/axis=0",
             "call/fixed(2),axis/[10, 3]/float32/axis=1",
             "call/fixed(2),axis/[1, 4]/float32/axis=0",
             "call/fixed(2),axis/[1, 4]/float32/axis=1",
             "call/fixed(2),axis/[0, 4]/float32/axis=0",
             "call/fixed(2),axis/[0, 4]/float32/axis=1",
             "call/fixed(2),axis/[4, 2, 3]/float32/axis=0",
             "call/fixed(2),axis/[4, 2, 3]/float32/axis=1",
             "call/fixed(2),axis/[4, 2, 3]/float32/axis=2",
             "call/fixed(2),axis/[3]/float32/axis=0",
             "call/min_size(4,3),axis/[10, 3]/float32/axis=0",
             "call/min_size(4,3),axis/[1, 4]/float32/axis=0",
             "call/min_size(4,3),axis/[10, 3]/float32/axis=1",
             "call/min_size(4,3),axis/[1, 4]/float32/axis=1",
             "call/min_size(4,3),axis/[10, 3]/float32/axis=2",
             "call/min_size(4,3),axis/[1, 4]/float32/axis=2"),
    **_group(FRACTIONAL_MIN_BYTES,
             "call/min_size(1.5,1000)/[100]/int8",
             "call/min_size(1.5,1000)/[1000]/int8",
             "call/min_size(2.5,1000)/[100]/int8",
             "call/min_size(2.5,1000)/[1000]/int8",
             "call/min_size(3.5,1000)/[100]/int8",
             "call/min_size(3.5,1000)/[1000]/int8",
             "call/min_size(3.5,1000)/[10, 3]/int8",
             "plan/ps3/min_size(1.5,100)/[100]/int8",
             "plan/ps3/min_size(2.5,100)/[100]/int8"),
    **_group(BYTES_PER_STRING,
             "call/min_size({'bytes_per_string': 0})/[10, 4]/float32",
             "call/min_size({'bytes_per_string': 4})/[10, 4]/float32",
             "call/min_size({'bytes_per_string': 1.5})/[10, 4]/float32",
             "call/min_size({'min_shard_bytes': 8, 'bytes_per_string': 100})/[10, 4]/float32",
             "plan/ps2/min_size(4,3,bytes_per_string=4)",
             "plan/ps2/min_size(bytes_per_string=0)"),
    **_group(MAX_SIZE,
             "call/max_size(10,none)/[100]/float32",
             "call/max_size(10,none)/[33, 3]/float32",
             "call/max_size(10,none)/[100]/float64",
             "call/max_size(10,none)/[33, 3]/float64",
             "call/max_size(10,none)/[100]/float16",
             "call/max_size(10,none)/[33, 3]/float16",
             "call/max_size(10,none)/[100]/bfloat16",
             "call/max_size(10,none)/[33, 3]/bfloat16",
             "call/max_size(10,none)/[100]/int8",
             "call/max_size(10,none)/[33, 3]/int8",
             "call/max_size(10,none)/[100]/int32",
             "call/max_size(10,none)/[33, 3]/int32",
             "call/max_size(10,none)/[100]/int64",
             "call/max_size(10,none)/[33, 3]/int64",
             "call/max_size(10,none)/[100]/bool",
             "call/max_size(10,none)/[33, 3]/bool",
             "call/max_size(1.5)/[100]/int8",
             "call/max_size(1.5)/[1000]/int8",
             "call/max_size(1.5)/[10, 3]/int8",
             "call/max_size(1.5)/[7, 7]/int8",
             "call/max_size(2.5)/[100]/int8",
             "call/max_size(2.5)/[1000]/int8",
             "call/max_size(2.5)/[10, 3]/int8",
             "call/max_size(2.5)/[7, 7]/int8",
             "call/max_size(3.5)/[100]/int8",
             "call/max_size(3.5)/[1000]/int8",
             "call/max_size(3.5)/[10, 3]/int8",
             "call/max_size(3.5)/[7, 7]/int8",
             "call/max_size(100.5)/[100]/int8",
             "call/max_size(100.5)/[1000]/int8",
             "call/max_size(100.5)/[10, 3]/int8",
             "call/max_size(100.5)/[7, 7]/int8",
             "call/max_size(4,None)/[6, 1]/float32",
             "call/max_size(4,None)/[10, 3]/float32",
             "call/max_size(4,None)/[1, 4]/float32",
             "call/max_size(4,None)/[0, 4]/float32",
             "call/max_size(4,None)/[7]/float32",
             "call/max_size(4,None)/[4, 2, 3]/float32",
             "call/max_size(4,None)/[1024, 1024]/float32",
             "call/max_size(4,2)/[6, 1]/float32",
             "call/max_size(4,2)/[10, 3]/float32",
             "call/max_size(4,2)/[1, 4]/float32",
             "call/max_size(4,2)/[0, 4]/float32",
             "call/max_size(4,2)/[7]/float32",
             "call/max_size(4,2)/[4, 2, 3]/float32",
             "call/max_size(4,2)/[1024, 1024]/float32",
             "call/max_size(1024,None)/[6, 1]/float32",
             "call/max_size(1024,None)/[10, 3]/float32",
             "call/max_size(1024,None)/[1, 4]/float32",
             "call/max_size(1024,None)/[0, 4]/float32",
             "call/max_size(1024,None)/[7]/float32",
             "call/max_size(1024,None)/[4, 2, 3]/float32",
             "call/max_size(1024,None)/[1024, 1024]/float32",
             "call/max_size(12,None)/[6, 1]/float32",
             "call/max_size(12,None)/[10, 3]/float32",
             "call/max_size(12,None)/[1, 4]/float32",
             "call/max_size(12,None)/[0, 4]/float32",
             "call/max_size(12,None)/[7]/float32",
             "call/max_size(12,None)/[4, 2, 3]/float32",
             "call/max_size(12,None)/[1024, 1024]/float32",
             "call/max_size(13,None)/[6, 1]/float32",
             "call/max_size(13,None)/[10, 3]/float32",
             "call/max_size(13,None)/[1, 4]/float32",
             "call/max_size(13,None)/[0, 4]/float32",
             "call/max_size(13,None)/[7]/float32",
             "call/max_size(13,None)/[4, 2, 3]/float32",
             "call/max_size(13,None)/[1024, 1024]/float32",
             "call/max_size(1,None)/[6, 1]/float32",
             "call/max_size(1,None)/[10, 3]/float32",
             "call/max_size(1,None)/[1, 4]/float32",
             "call/max_size(1,None)/[0, 4]/float32",
             "call/max_size(1,None)/[7]/float32",
             "call/max_size(1,None)/[4, 2, 3]/float32",
             "call/max_size(1,None)/[1024, 1024]/float32",
             "call/max_size(1.5,None)/[6, 1]/float32",
             "call/max_size(1.5,None)/[10, 3]/float32",
             "call/max_size(1.5,None)/[1, 4]/float32",
             "call/max_size(1.5,None)/[0, 4]/float32",
             "call/max_size(1.5,None)/[7]/float32",
             "call/max_size(1.5,None)/[4, 2, 3]/float32",
             "call/max_size(1.5,None)/[1024, 1024]/float32",
             "call/max_size(100.5,3)/[6, 1]/float32",
             "call/max_size(100.5,3)/[10, 3]/float32",
             "call/max_size(100.5,3)/[1, 4]/float32",
             "call/max_size(100.5,3)/[0, 4]/float32",
             "call/max_size(100.5,3)/[7]/float32",
             "call/max_size(100.5,3)/[4, 2, 3]/float32",
             "call/max_size(100.5,3)/[1024, 1024]/float32",
             "call/max_size(16,0)/[6, 1]/float32",
             "call/max_size(16,0)/[10, 3]/float32",
             "call/max_size(16,0)/[1, 4]/float32",
             "call/max_size(16,0)/[0, 4]/float32",
             "call/max_size(16,0)/[7]/float32",
             "call/max_size(16,0)/[4, 2, 3]/float32",
             "call/max_size(16,0)/[1024, 1024]/float32",
             "call/max_size(3,1000)/[6, 1]/float32",
             "call/max_size(3,1000)/[10, 3]/float32",
             "call/max_size(3,1000)/[1, 4]/float32",
             "call/max_size(3,1000)/[0, 4]/float32",
             "call/max_size(3,1000)/[7]/float32",
             "call/max_size(3,1000)/[4, 2, 3]/float32",
             "call/max_size(3,1000)/[1024, 1024]/float32",
             "call/max_size(4,max_shards=None)/[6, 1]/float32",
             "call/max_size(4)/[]/float32",
             "call/max_size({'max_shard_bytes': 0})/[10, 4]/float32",
             "call/max_size({'max_shard_bytes': -3})/[10, 4]/float32",
             "call/max_size({'max_shard_bytes': 8, 'max_shards': -1})/[10, 4]/float32",
             "call/max_size({'max_shard_bytes': 8, 'bytes_per_string': 0})/[10, 4]/float32",
             "call/max_size({'max_shard_bytes': 8, 'bytes_per_string': 2})/[10, 4]/float32",
             "call/max_size(4),axis/[10, 3]/float32/axis=0",
             "call/max_size(4),axis/[10, 3]/float32/axis=1",
             "call/max_size(4),axis/[10, 3]/float32/axis=2",
             "plan/ps2/max_size(4,None)/[6, 1]",
             "plan/ps2/max_size(4,None)/[10, 3]",
             "plan/ps2/max_size(4,None)/[1, 4]",
             "plan/ps2/max_size(4,None)/[0, 4]",
             "plan/ps2/max_size(4,None)/[7]",
             "plan/ps2/max_size(12,2)/[6, 1]",
             "plan/ps2/max_size(12,2)/[10, 3]",
             "plan/ps2/max_size(12,2)/[1, 4]",
             "plan/ps2/max_size(12,2)/[0, 4]",
             "plan/ps2/max_size(12,2)/[7]",
             "plan/ps2/max_size(1024,None)/[6, 1]",
             "plan/ps2/max_size(1024,None)/[10, 3]",
             "plan/ps2/max_size(1024,None)/[1, 4]",
             "plan/ps2/max_size(1024,None)/[0, 4]",
             "plan/ps2/max_size(1024,None)/[7]",
             "plan/ps2/max_size(1.5,None)/[6, 1]",
             "plan/ps2/max_size(1.5,None)/[10, 3]",
             "plan/ps2/max_size(1.5,None)/[1, 4]",
             "plan/ps2/max_size(1.5,None)/[0, 4]",
             "plan/ps2/max_size(1.5,None)/[7]",
             "plan/ps2/max_size(16,0)/[6, 1]",
             "plan/ps2/max_size(16,0)/[10, 3]",
             "plan/ps2/max_size(16,0)/[1, 4]",
             "plan/ps2/max_size(16,0)/[0, 4]",
             "plan/ps2/max_size(16,0)/[7]"),
}


def _params(kind: str) -> list:
    out = []
    for case in cases(kind):
        reason = KNOWN_DIFFERENCES.get(case["id"])
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(case, id=case["id"], marks=marks))
    return out


@pytest.mark.parametrize("case", _params("call"))
def test_a_partitioner_answers_as_tfs(case):
    check(csrun_call(case), case["tf"], "call")


@pytest.mark.parametrize("case", _params("plan"))
def test_variables_are_sharded_and_placed_as_tf_places_them(case):
    check(csrun_plan(case), case["tf"], "plan")


def test_the_golden_is_tf_2_21s_and_every_known_difference_names_a_case():
    meta = golden()["meta"]
    assert meta["tensorflow"].startswith("2.21.")
    ids = [case["id"] for case in golden()["cases"]]
    assert len(ids) == len(set(ids)) == meta["cases"]
    assert not set(KNOWN_DIFFERENCES) - set(ids), "stale KNOWN_DIFFERENCES entries"


def test_the_comparison_tells_a_moved_variable_and_a_crash_apart():
    [case] = [c for c in cases("plan") if c["id"] == "plan/ps3/colocate/issue_37"]
    moved = copy.deepcopy(case["tf"])
    moved["variables"][3][0]["ps"] = 0
    with pytest.raises(AssertionError, match="TF places"):
        check(moved, case["tf"], "plan")
    crash = {"error": {"type": "ZeroDivisionError", "message": "", "crash": True}}
    with pytest.raises(AssertionError, match="must refuse clearly"):
        check({"error": "IndexError", "message": "x"}, crash, "plan")
    check({"error": "ValueError", "message": "zero rows"}, crash, "plan")
