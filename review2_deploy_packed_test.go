package idempotency_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The same with a repeated scalar field the old build does not know, sent
// unpacked (proto2's default encoding, which every parser accepts): the
// old build keeps the unpacked bytes, the new build re-encodes the field
// packed (proto3's default), and the derived keys differ across the
// deploy, though the engine replays the stored result across it.
func TestReview2DeployPackingARepeatedFieldChangesDerivedKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := review2Field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	oldSchema := review2Schema(t, "proto3", amount)
	newSchema := review2Schema(t, "proto3", amount, review2Field("items", 3, descriptorpb.FieldDescriptorProto_TYPE_INT64, true))
	var oldKeys, newKeys keyLog
	oldBuild := review2PayServer(t, store, oldSchema, &oldKeys, crashes)
	newBuild := review2PayServer(t, store, newSchema, &newKeys, nil)
	body := varintField(varintField(varintField(nil, 1, 500), 3, 7), 3, 8) // items 7, 8 unpacked
	var check []byte
	for b := body; len(b) > 0; {
		_, _, n := protowire.ConsumeField(b)
		require.Positive(t, n)
		check, b = append(check, b[:n]...), b[n:]
	}
	require.Equal(t, body, check, "a valid encoding")

	okOld := review2PayServer(t, store, oldSchema, &keyLog{}, nil)
	first := sendRaw(okOld, "stored-1", body)
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(newBuild, "stored-1", body), "the same request across the deploy")

	require.Equal(t, codes.Unavailable, status.Code(sendRaw(oldBuild, "order-8", body).err), "the old build crashes after charging")
	require.NoError(t, sendRaw(newBuild, "order-8", body).err, "the new build runs the call again")
	require.Equal(t, oldKeys.all(), newKeys.all(), "the re-run after the deploy must send the provider the key the first run sent")
}
