package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// descriptorsHelp says how to make a file -proto-descriptors reads.
const descriptorsHelp = "buf build -o FILE, or protoc --include_imports --descriptor_set_out=FILE"

// protoTypes finds the message types of stored responses, and of the
// details of stored errors: first those linked into the command (the
// well-known types, google.rpc's), then those of the descriptor sets given
// with -proto-descriptors, decoded as dynamic messages.
type protoTypes struct {
	sets *dynamicpb.Types // nil without -proto-descriptors
}

var _ interface {
	protoregistry.MessageTypeResolver
	protoregistry.ExtensionTypeResolver
} = protoTypes{}

// loadProtoTypes reads the descriptor sets at paths: FileDescriptorSets
// (protoc --descriptor_set_out, with --include_imports) or buf images (buf
// build -o), which are FileDescriptorSets with buf's extra fields. An
// import no set holds is looked for among the files linked into the
// command.
func loadProtoTypes(paths []string) (protoTypes, error) {
	if len(paths) == 0 {
		return protoTypes{}, nil
	}
	files, err := loadProtoFiles(paths)
	if err != nil {
		return protoTypes{}, err
	}
	return protoTypes{sets: dynamicpb.NewTypes(files)}, nil
}

// loadProtoFiles reads the descriptor sets at paths (see loadProtoTypes).
func loadProtoFiles(paths []string) (*protoregistry.Files, error) {
	var pending []*descriptorpb.FileDescriptorProto
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("-proto-descriptors: %w", err)
		}
		set := &descriptorpb.FileDescriptorSet{}
		if err := proto.Unmarshal(b, set); err != nil || len(set.GetFile()) == 0 {
			return nil, fmt.Errorf("-proto-descriptors: %s is not a binary FileDescriptorSet or buf image (make one with %s)", path, descriptorsHelp)
		}
		pending = append(pending, set.GetFile()...)
	}
	files, err := registerFiles(pending)
	if err != nil {
		return nil, fmt.Errorf("-proto-descriptors: %w (a set lacking its imports was made without --include_imports: make it with %s)", err, descriptorsHelp)
	}
	return files, nil
}

// registerFiles builds a registry of the files pending. A set need not
// list a file after its imports: files whose imports are not registered
// yet wait for the next pass. An import none of them is is looked for
// among the files linked into the command.
func registerFiles(pending []*descriptorpb.FileDescriptorProto) (*protoregistry.Files, error) {
	files := new(protoregistry.Files)
	resolver := fileResolver{files}
	for len(pending) > 0 {
		var next []*descriptorpb.FileDescriptorProto
		var lastErr error
		for _, fdp := range pending {
			if _, err := files.FindFileByPath(fdp.GetName()); err == nil {
				continue // listed twice
			}
			fd, err := protodesc.NewFile(fdp, resolver)
			if err == nil {
				err = files.RegisterFile(fd)
			}
			if err != nil {
				next, lastErr = append(next, fdp), fmt.Errorf("%s: %w", fdp.GetName(), err)
			}
		}
		if len(next) == len(pending) {
			return nil, lastErr
		}
		pending = next
	}
	return files, nil
}

// fileResolver resolves imports among the sets' files, then among the
// command's.
type fileResolver struct{ files *protoregistry.Files }

func (r fileResolver) FindFileByPath(path string) (protoreflect.FileDescriptor, error) {
	if fd, err := r.files.FindFileByPath(path); err == nil {
		return fd, nil
	}
	return protoregistry.GlobalFiles.FindFileByPath(path)
}

func (r fileResolver) FindDescriptorByName(name protoreflect.FullName) (protoreflect.Descriptor, error) {
	if d, err := r.files.FindDescriptorByName(name); err == nil {
		return d, nil
	}
	return protoregistry.GlobalFiles.FindDescriptorByName(name)
}

// find looks a type up among the command's, then the sets'.
func find[T any](global, sets func() (T, error)) (T, error) {
	t, err := global()
	if err == nil || !errors.Is(err, protoregistry.NotFound) {
		return t, err
	}
	if sets == nil {
		return t, err
	}
	return sets()
}

// FindMessageByName implements protoregistry.MessageTypeResolver.
func (p protoTypes) FindMessageByName(name protoreflect.FullName) (protoreflect.MessageType, error) {
	return find(func() (protoreflect.MessageType, error) { return protoregistry.GlobalTypes.FindMessageByName(name) },
		orNil(p, func() (protoreflect.MessageType, error) { return p.sets.FindMessageByName(name) }))
}

// FindMessageByURL implements protoregistry.MessageTypeResolver, for the
// google.protobuf.Any a response or an error's details hold.
func (p protoTypes) FindMessageByURL(url string) (protoreflect.MessageType, error) {
	return find(func() (protoreflect.MessageType, error) { return protoregistry.GlobalTypes.FindMessageByURL(url) },
		orNil(p, func() (protoreflect.MessageType, error) { return p.sets.FindMessageByURL(url) }))
}

// FindExtensionByName implements protoregistry.ExtensionTypeResolver.
func (p protoTypes) FindExtensionByName(name protoreflect.FullName) (protoreflect.ExtensionType, error) {
	return find(func() (protoreflect.ExtensionType, error) { return protoregistry.GlobalTypes.FindExtensionByName(name) },
		orNil(p, func() (protoreflect.ExtensionType, error) { return p.sets.FindExtensionByName(name) }))
}

// FindExtensionByNumber implements protoregistry.ExtensionTypeResolver.
func (p protoTypes) FindExtensionByNumber(message protoreflect.FullName, field protoreflect.FieldNumber) (protoreflect.ExtensionType, error) {
	return find(func() (protoreflect.ExtensionType, error) {
		return protoregistry.GlobalTypes.FindExtensionByNumber(message, field)
	}, orNil(p, func() (protoreflect.ExtensionType, error) { return p.sets.FindExtensionByNumber(message, field) }))
}

// orNil is f when there are sets to look in.
func orNil[T any](p protoTypes, f func() (T, error)) func() (T, error) {
	if p.sets == nil {
		return nil
	}
	return f
}

// unknownTypeHint tells how to have a response of an unknown type decoded.
func unknownTypeHint(name string) string {
	return fmt.Sprintf("the command does not know the message type %s: give it -proto-descriptors FILE, a descriptor set of your protos (%s)",
		strings.TrimSpace(name), descriptorsHelp)
}
