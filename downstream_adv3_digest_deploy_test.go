package idempotency_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The most common deploy: a newer client already sends a message field
// (google.protobuf.Int64Value tip = 2) that the build it reaches does not
// declare yet; the call crashes after charging, and its re-run reaches the
// new build, which declares the field. The declared field's canonical
// encoding is the bytes the old build held as unknown: the re-run derives
// the key the first run sent. (It failed when a declared message was
// hashed as its sum and an unknown one as its bytes.)
func TestDeployDeclaringAMessageFieldKeepsTheKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := review2Field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	tip := review2Field("tip", 2, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	tip.TypeName = proto.String(".google.protobuf.Int64Value")
	oldMd := review2Schema(t, "proto3", amount)
	newMd := review2SchemaWith(t, []string{"google/protobuf/wrappers.proto"}, amount, tip)

	var oldKeys, newKeys keyLog
	oldConn := review2PayServer(t, store, oldMd, &oldKeys, crashes)
	newConn := review2PayServer(t, store, newMd, &newKeys, crashes)
	tipBytes, err := proto.Marshal(wrapperspb.Int64(100))
	require.NoError(t, err)
	body := bytesField(varintField(nil, 1, 500), 2, tipBytes)

	require.Equal(t, codes.Unavailable, status.Code(sendRaw(oldConn, "order-1", body).err))
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(newConn, "order-1", body).err))
	require.Len(t, oldKeys.all(), 1)
	require.Len(t, newKeys.all(), 1)
	require.Equal(t, oldKeys.all()[0], newKeys.all()[0],
		"the build that declares the message field derives another key than the build that held it as unknown sent")
}
