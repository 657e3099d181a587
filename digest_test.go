package idempotency

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// The canonical encoding a request's digest hashes is an encoding of the
// request itself, nothing added: decoded, it is the request. That is what
// makes two requests the engine tells apart digest differently.
func TestUnitCanonicalEncodingDecodesToTheRequest(t *testing.T) {
	st, err := structpb.NewStruct(map[string]any{"b": 2, "a": "x", "c": []any{1, "y", map[string]any{"z": true}}})
	require.NoError(t, err)
	packed, err := anypb.New(st)
	require.NoError(t, err)
	for _, req := range []proto.Message{
		benchRequest(64),
		&testingv1.Request{Meta: &testingv1.Meta{RequestId: "r"}},
		st,
		packed,
		&structpb.ListValue{Values: []*structpb.Value{structpb.NewStructValue(st), structpb.NewStringValue("MangoEagle")}},
	} {
		require.Equal(t, requestDigest(req), requestDigest(proto.Clone(req)), "%T: one request, one digest", req)
		d := new(digester)
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
		require.NoError(t, err)
		from, to, ok := d.canonical(b, req.ProtoReflect().Descriptor(), 0)
		require.True(t, ok)
		got := req.ProtoReflect().New().Interface()
		require.NoError(t, proto.Unmarshal(d.arena[from:to], got))
		if a, ok := got.(*anypb.Any); ok { // its packed message is encoded again
			want, err := req.(*anypb.Any).UnmarshalNew()
			require.NoError(t, err)
			inner, err := a.UnmarshalNew()
			require.NoError(t, err)
			require.Equal(t, req.(*anypb.Any).GetTypeUrl(), a.GetTypeUrl())
			req, got = want, inner
		}
		require.True(t, proto.Equal(req, got), "%T: the canonical encoding decodes to the request", req)

	}
}
