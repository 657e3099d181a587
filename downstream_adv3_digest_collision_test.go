package idempotency_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A message field numbered 14 (its tag byte is 0x72) followed by another
// field, and one raw field whose bytes start the same: two requests the
// engine tells apart. The digest hashes a canonical encoding of the
// request with nothing added, so they derive different keys. (It failed
// when the digest marked raw fields with 'r', 0x72: a pair was found in
// about 44,000 hashes.)
func TestDigestOfAMessageFieldNeverCollidesWithARawField(t *testing.T) {
	t.Parallel()
	blob := review2Field("blob", 1, descriptorpb.FieldDescriptorProto_TYPE_BYTES, false)
	sub := review2Field("sub", 14, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	sub.TypeName = proto.String(".google.protobuf.Int64Value")
	pad := review2Field("pad", 15, descriptorpb.FieldDescriptorProto_TYPE_BYTES, false)
	md := review2SchemaWith(t, []string{"google/protobuf/wrappers.proto"}, blob, sub, pad)

	// A sum that reads as the tag of field 1 (bytes) and a length of 107.
	var n int64
	var sum [32]byte
	for n = 1; ; n++ {
		sum = idempotency.RequestDigest(wrapperspb.Int64(n))
		if sum[0] == 0x0a && sum[1] == 107 {
			break
		}
		require.Less(t, n, int64(50_000_000), "no sum found")
	}
	subBytes, err := proto.Marshal(wrapperspb.Int64(n))
	require.NoError(t, err)
	padField := bytesField(nil, 15, bytes.Repeat([]byte{'p'}, 73)) // 75 bytes
	require.Len(t, padField, 75)
	first := append(bytesField(nil, 14, subBytes), padField...) // {sub: n, pad: "ppp..."}
	second := bytesField(nil, 1, append(append(append([]byte(nil), sum[2:]...), 'r', byte(len(padField))), padField...))

	decode := func(b []byte) *dynamicpb.Message {
		m := dynamicpb.NewMessage(md)
		require.NoError(t, proto.Unmarshal(b, m))
		return m
	}
	a, b := decode(first), decode(second)
	require.False(t, proto.Equal(a, b), "two different requests")
	fa, _ := idempotency.Fingerprint(methodPay, a)
	fb, _ := idempotency.Fingerprint(methodPay, b)
	require.NotEqual(t, fa, fb, "the engine tells them apart")

	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	// Under a stored result, the second request is another request.
	var stored keyLog
	ok := review2PayServer(t, store, md, &stored, nil)
	require.NoError(t, sendRaw(ok, "order-kept", first).err)
	requireKeyReused(t, sendRaw(ok, "order-kept", second), "the second request under the first's stored result")

	// Under a released key, it runs as another operation: its downstream
	// keys must be its own.
	var keys keyLog
	conn := review2PayServer(t, store, md, &keys, crashes)
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", first).err))
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", second).err))
	k := keys.all()
	require.Len(t, k, 2)
	require.NotEqual(t, k[0], k[1], "two requests the engine tells apart derive the same downstream key (sub=%d)", n)
}
