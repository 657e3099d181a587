package idempotency_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// The keys a gRPC request derives for its downstream calls, end to end: a
// retry that the request comparison calls the same request, sent another
// way, derives the keys its first run sent.

// It failed when the request's digest hashed what the comparison does not
// compare: a run that derived its effect's key and failed with
// Unavailable (the key released), then its retry with a double sent as -0
// instead of 0, with an optional field set to its default instead of
// unset, or with an Any's type URL under another prefix (each the same
// request to the comparison: a third send of the first encoding replays
// the retry's answer) derived another key, and a provider charged again.
func TestGRPCRetryOfTheSameRequestDerivesTheSameKeys(t *testing.T) {
	t.Parallel()
	const double, int64Kind, message = descriptorpb.FieldDescriptorProto_TYPE_DOUBLE, descriptorpb.FieldDescriptorProto_TYPE_INT64, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE
	md := paySchema(t, "proto3", []payField{
		{name: "amount", number: 1, kind: int64Kind},
		{name: "rate", number: 2, kind: double},
		{name: "tip", number: 3, kind: int64Kind, optional: true},
		{name: "rates", number: 4, kind: double},
		{name: "detail", number: 5, kind: message, typeName: ".google.protobuf.Any"},
		{name: "share", number: 6, kind: double, optional: true},
	}, false, "google/protobuf/any.proto")
	fixed64 := func(num protowire.Number, v float64) []byte {
		return protowire.AppendFixed64(protowire.AppendTag(nil, num, protowire.Fixed64Type), math.Float64bits(v))
	}
	negZero := math.Copysign(0, -1)
	amount := slices.Clip(varintField(nil, 1, 250)) // appended to by several cases
	detail := func(url string) []byte {
		v, err := proto.Marshal(wrapperspb.String("order-77"))
		require.NoError(t, err)
		return bytesField(amount, 5, bytesField(bytesField(nil, 1, []byte(url)), 2, v))
	}
	for _, c := range []struct {
		name         string
		first, retry []byte
	}{
		{"a double sent as -0, then not at all (0)", append(fixed64(2, negZero), amount...), amount},
		{"an optional double sent as -0, then as 0", append(fixed64(6, negZero), amount...), append(fixed64(6, 0), amount...)},
		{"an optional field sent as its default, then unset", varintField(amount, 3, 0), amount},
		{"an Any's type URL under another prefix", detail("type.googleapis.com/google.protobuf.StringValue"), detail("example.com/google.protobuf.StringValue")},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			store := migratedStore(t, suiteDB(t))
			var mu sync.Mutex
			var sent []string
			conn := servePay(t, store, md, func(ctx context.Context, _ proto.Message) (any, error) {
				k, ok := idempotency.EffectKey(ctx, "charge order-77")
				require.True(t, ok)
				mu.Lock()
				defer mu.Unlock()
				sent = append(sent, k)
				if len(sent) == 1 {
					return nil, status.Error(codes.Unavailable, "the provider charged; the answer is lost")
				}
				return wrapperspb.String(fmt.Sprintf("run %d", len(sent))), nil
			})
			first := sendRaw(conn, "order-77", c.first)
			require.Equal(t, codes.Unavailable, status.Code(first.err), "%v", first.err)
			retry := sendRaw(conn, "order-77", c.retry)
			require.NoError(t, retry.err)
			again := sendRaw(conn, "order-77", c.first)
			requireReplayOf(t, retry, again, "the first encoding: the same request")
			require.Len(t, sent, 2)
			require.Equal(t, sent[0], sent[1], "the retry of the same request derived another key")
		})
	}
}
