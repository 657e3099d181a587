package idempotency_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// A Struct packed in an Any, sent as [k:1][k:2] (it holds k=2) and as
// [k:2][k:1] (k=1): two requests. The packed message is decoded and
// encoded again, the last entry winning as in any decoder, so they derive
// different keys. (It failed when entries were sorted as bytes.)
func TestDuplicateMapKeyInsideAnAnyDerivesOtherKeys(t *testing.T) {
	t.Parallel()
	entry := func(v float64) []byte {
		val := protowire.AppendFixed64(protowire.AppendTag(nil, 2, protowire.Fixed64Type), math.Float64bits(v))
		return bytesField(nil, 1, bytesField(bytesField(nil, 1, []byte("k")), 2, val))
	}
	a := append(entry(1), entry(2)...)
	b := append(entry(2), entry(1)...)
	sa, sb := &structpb.Struct{}, &structpb.Struct{}
	require.NoError(t, proto.Unmarshal(a, sa))
	require.NoError(t, proto.Unmarshal(b, sb))
	require.Equal(t, 2.0, sa.GetFields()["k"].GetNumberValue())
	require.Equal(t, 1.0, sb.GetFields()["k"].GetNumberValue())
	adv3AnyPair(t, "type.googleapis.com/google.protobuf.Struct", a, b)
}
