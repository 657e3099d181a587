package idempotency_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// adv3AnyPair sends two requests {amount: 500, extra: Any packing typeURL
// with value a (then b)}: first under a stored result (the engine must
// tell them apart: KEY_REUSED), then under a released key (the second runs
// as another operation: its downstream key must be its own).
func adv3AnyPair(t *testing.T, typeURL string, a, b []byte) {
	t.Helper()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := review2Field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	anyField := review2Field("extra", 4, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	anyField.TypeName = proto.String(".google.protobuf.Any")
	md := review2SchemaWith(t, []string{"google/protobuf/any.proto"}, amount, anyField)
	encode := func(v []byte) []byte {
		return bytesField(varintField(nil, 1, 500), 4, bytesField(bytesField(nil, 1, []byte(typeURL)), 2, v))
	}
	var stored keyLog
	kept := review2PayServer(t, store, md, &stored, nil)
	require.NoError(t, sendRaw(kept, "order-kept", encode(a)).err)
	requireKeyReused(t, sendRaw(kept, "order-kept", encode(b)), "another packed message under the first's stored result")

	var keys keyLog
	conn := review2PayServer(t, store, md, &keys, crashes)
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", encode(a)).err))
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", encode(b)).err))
	k := keys.all()
	require.Len(t, k, 2)
	require.NotEqual(t, k[0], k[1], "two requests the engine tells apart derive the same downstream key")
}

// A google.protobuf.Value packed in an Any, sent as [number 1][string "x"]
// (the string is set) and the other way round (the number is): two
// requests, two sets of keys, as the packed message is decoded and encoded
// again. (It failed when its fields were sorted as they came.)
func TestOneofOrderInsideAnAnyDerivesOtherKeys(t *testing.T) {
	t.Parallel()
	num := protowire.AppendFixed64(protowire.AppendTag(nil, 2, protowire.Fixed64Type), math.Float64bits(1))
	str := bytesField(nil, 3, []byte("x"))
	a := append(append([]byte(nil), num...), str...)
	b := append(append([]byte(nil), str...), num...)
	va, vb := &structpb.Value{}, &structpb.Value{}
	require.NoError(t, proto.Unmarshal(a, va))
	require.NoError(t, proto.Unmarshal(b, vb))
	require.Equal(t, "x", va.GetStringValue())
	require.Equal(t, 1.0, vb.GetNumberValue())
	adv3AnyPair(t, "type.googleapis.com/google.protobuf.Value", a, b)
}
