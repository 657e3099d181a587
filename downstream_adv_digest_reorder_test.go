package idempotency_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// What the request digest of derived keys makes of a request: two
// different requests must never derive the same keys, and one request sent
// byte for byte again, across a deploy, must derive the same.

// review2Schema builds idempotency.test.PayRequest of one release from
// field declarations (each a separate build: nothing is registered).
func review2Schema(t *testing.T, syntax string, fields ...*descriptorpb.FieldDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	msg := &descriptorpb.DescriptorProto{Name: proto.String("PayRequest"), Field: fields}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/pay.proto"), Package: proto.String("idempotency.test"),
		Syntax: proto.String(syntax), MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().Get(0)
}

func review2Field(name string, number int32, kind descriptorpb.FieldDescriptorProto_Type, repeated bool) *descriptorpb.FieldDescriptorProto {
	label := descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
	if repeated {
		label = descriptorpb.FieldDescriptorProto_LABEL_REPEATED
	}
	return &descriptorpb.FieldDescriptorProto{
		Name: proto.String(name), Number: proto.Int32(number), Type: kind.Enum(), Label: label.Enum(), JsonName: proto.String(name),
	}
}

// review2PayServer serves methodPay with requests decoded as md on store;
// the handler records the key of the effect "charge", then answers with
// fail(req) when it is not nil, else succeeds.
func review2PayServer(t *testing.T, store *idempotency.Store, md protoreflect.MessageDescriptor, keys *keyLog, fail func(proto.Message) error) *grpc.ClientConn {
	t.Helper()
	return servePay(t, store, md, func(ctx context.Context, req proto.Message) (any, error) {
		k, ok := idempotency.EffectKey(ctx, "charge")
		if !ok {
			return nil, status.Error(codes.Internal, "no running call")
		}
		keys.add(k)
		if fail != nil {
			if err := fail(req); err != nil {
				return nil, err
			}
		}
		return wrapperspb.String("charged"), nil
	})
}

// crashes is a handler outcome that releases the key after the charge went
// out: the process "died" before its commit.
func crashes(proto.Message) error {
	return status.Error(codes.Unavailable, "the process dies after charging, before its commit")
}

// A corrected request that only reorders a repeated field (the order in
// which recipients are paid, line items, steps) is another request to the
// engine, and sent again under a released key it runs as another
// operation: its derived keys differ from the first request's. (It failed
// when the digest sorted a list's elements like a message's fields, and
// the provider deduplicated the corrected operation into the first.)
func TestReorderedRepeatedFieldDerivesOtherKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	md := review2Schema(t, "proto3", review2Field("recipients", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING, true))
	var keys keyLog
	conn := review2PayServer(t, store, md, &keys, func(req proto.Message) error {
		// The first recipient's request is the one that fails here.
		if req.ProtoReflect().Get(md.Fields().ByName("recipients")).List().Get(0).String() == "alice" {
			return crashes(req)
		}
		return nil
	})
	ab := bytesField(bytesField(nil, 1, []byte("alice")), 1, []byte("bob"))
	ba := bytesField(bytesField(nil, 1, []byte("bob")), 1, []byte("alice"))

	// The engine tells the two orders apart: a stored result under one
	// key refuses the other order.
	require.NoError(t, sendRaw(conn, "stored-1", ba).err)
	requireKeyReused(t, sendRaw(conn, "stored-1", ab), "the other order is another request to the engine")

	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", ab).err))
	require.NoError(t, sendRaw(conn, "order-1", ba).err, "the corrected request runs under the released key")
	k := keys.all()
	require.Len(t, k, 3, "the refused request ran nothing")
	require.NotEqual(t, k[1], k[2], "a corrected request (recipients reordered) is another operation: it must not send the first one's key")
}
