package idempotency

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

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
		require.Equal(t, requestDigest(req, defaultDerivedKeyVersion), requestDigest(proto.Clone(req), defaultDerivedKeyVersion), "%T: one request, one digest", req)
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

// A request's digest follows the request comparison: two requests that
// Fingerprint calls the same have one digest, and two it tells apart have
// two. (It failed for -0 against 0, a field with presence set to its
// default against unset, and an Any's type URL under another prefix,
// which the comparison calls the same.) Unknown fields are the exception
// (see requestDigest). Requests written one way already keep the digest
// of the release before (version 2), so a call in flight across the
// upgrade keeps its keys.
func TestRequestDigestFollowsTheComparison(t *testing.T) {
	t.Parallel()
	negZero := math.Copysign(0, -1)
	packedURL := func(prefix string) *anypb.Any {
		v, err := proto.Marshal(wrapperspb.String("order-77"))
		require.NoError(t, err)
		return &anypb.Any{TypeUrl: prefix + "google.protobuf.StringValue", Value: v}
	}
	speed := descriptorpb.FileOptions_SPEED
	size := descriptorpb.FileOptions_CODE_SIZE
	for _, c := range []struct {
		name string
		a, b proto.Message
		same bool
	}{
		{"-0 and 0", wrapperspb.Double(negZero), wrapperspb.Double(0), true},
		{"a float's -0 and 0", wrapperspb.Float(float32(negZero)), wrapperspb.Float(0), true},
		{"two NaNs", wrapperspb.Double(math.NaN()), wrapperspb.Double(math.Float64frombits(0x7ff8000000000abc)), true},
		{"-0 and 0 in a real oneof", structpb.NewNumberValue(negZero), structpb.NewNumberValue(0), true},
		{"-0 and 0 in a list", &structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(negZero)}},
			&structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(0)}}, true},
		{"a proto2 field set to its zero default and unset", &descriptorpb.FieldDescriptorProto{Number: proto.Int32(0)}, &descriptorpb.FieldDescriptorProto{}, true},
		{"a proto2 string set to its default and unset", &descriptorpb.FieldDescriptorProto{Name: proto.String("")}, &descriptorpb.FieldDescriptorProto{}, true},
		{"a proto2 field set to its declared default and unset", &descriptorpb.FileOptions{OptimizeFor: &speed}, &descriptorpb.FileOptions{}, true},
		{"an Any's type URL under another prefix", packedURL("type.googleapis.com/"), packedURL("example.com/"), true},
		{"0 and 1", wrapperspb.Double(0), wrapperspb.Double(1), false},
		{"a proto2 field set to another value and unset", &descriptorpb.FileOptions{OptimizeFor: &size}, &descriptorpb.FileOptions{}, false},
		{"a real oneof set to its default and unset", structpb.NewNumberValue(0), &structpb.Value{}, false},
		{"another packed message", packedURL("type.googleapis.com/"), &anypb.Any{TypeUrl: "type.googleapis.com/google.protobuf.StringValue"}, false},
	} {
		fa, err := Fingerprint("/m", c.a)
		require.NoError(t, err)
		fb, err := Fingerprint("/m", c.b)
		require.NoError(t, err)
		require.Equal(t, c.same, sameRequest(fa, fb), "%s: the comparison", c.name)
		require.Equal(t, c.same, requestDigest(c.a, defaultDerivedKeyVersion) == requestDigest(c.b, defaultDerivedKeyVersion), "%s: one digest", c.name)
	}
	st, err := structpb.NewStruct(map[string]any{"b": 2, "a": "x", "c": []any{1.5, "y", map[string]any{"z": true}}})
	require.NoError(t, err)
	packed, err := anypb.New(st)
	require.NoError(t, err)
	for _, req := range []proto.Message{benchRequest(64), st, packed, &descriptorpb.FileOptions{OptimizeFor: &size}} {
		require.Equal(t, requestDigest(req, 2), requestDigest(req, defaultDerivedKeyVersion), "%T: the digest of the release before", req)
	}
	require.NotEqual(t, requestDigest(wrapperspb.Double(negZero), 2), requestDigest(wrapperspb.Double(negZero), defaultDerivedKeyVersion), "version 2 writes nothing one way")
}
